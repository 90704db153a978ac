"""The README's "With Hugging Face / Accelerate / Lightning" examples run as written."""

import pathlib
import re

import pytest
from optional_deps import need

_README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
_SECTION = _README.read_text().split("## With Hugging Face / Accelerate / Lightning", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", _SECTION, flags=re.S)


def test_the_section_has_its_three_examples():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["hf_trainer", "accelerate", "lightning"])
def test_readme_example_runs(index):
    code = BLOCKS[index]
    for package in sorted(set(re.findall(r"^(?:import|from) (\w+)", code, flags=re.M)) - {"mixprec", "torch",
                                                                                          "tempfile"}):
        need(package)
    need("tensorboard") if "SummaryWriter" in code else None
    exec(compile(code, f"README example {index}", "exec"), {"__name__": f"readme_example_{index}"})
