"""Every code block of the README and of the user guide (docs/*.md) runs, and the guide builds as a site.

What "runs" means per kind of block:

- ```` ```python ```` blocks are executed; ``>>>`` blocks run as doctests and must print what they show,
  and so must a python block with an output block right below it (the page's picture of its output).
- Shell blocks (```` ```bash ```` and output blocks holding ``$ ...`` lines): each ``mixprec ...`` command
  is parsed by the real CLI parser (a renamed or removed flag fails here), each ``make X`` names a
  target of the Makefile. Running them would train models for minutes; the tools themselves are tested
  in tests/test_cli.py and the lab's tests.
- Output-only blocks (no ``$`` line) are pictures of a report, not code.

A block that cannot run here is marked on its page by the line before it: ``<!-- docs-test: skip:
REASON -->`` (it is reported as skipped with that reason: ``pytest -rs tests/test_docs.py``). A block
marked ``<!-- docs-test: continue -->`` runs in the namespace the previous block of its page left.
Any other block starts from ``_given()``: the names a fragment of a page takes as given (a model, an
optimizer, an engine, a few batches), so ``for x, y in loader: ...`` runs as written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import importlib
import io
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|continue)\s*:?\s*(.*?)\s*-->")
_OPTIONAL = {"transformers", "accelerate", "lightning", "tensorboard", "timm", "torchvision"}


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int            # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None   # "skip" or "continue"
    reason: str
    shown: str | None = None   # an output block right below a python block: what it must print

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def commands(self) -> list[str]:
        """The shell command lines of a bash block, or the ``$ ...`` lines of an output block."""
        if self.lang == "bash":
            return [ln.split(" #")[0].strip() for ln in self.code.splitlines() if ln.strip()
                    and not ln.lstrip().startswith("#")]
        return [ln[2:].strip() for ln in self.code.splitlines() if ln.startswith("$ ")]


def blocks_of(page: pathlib.Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARKER.search(before)
        found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           mark.group(1) if mark else None, mark.group(2) if mark else ""))
        if found[-1].lang == "python" and end + 1 < len(lines) and lines[end + 1] == "```":
            close = next(j for j in range(end + 2, len(lines)) if lines[j].startswith("```"))
            found[-1].shown = "\n".join(lines[end + 2:close])
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks_of(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
SHELL = [b for b in ALL if b.lang == "bash" or (b.lang in ("", "text", "console") and b.commands)]


# ------------------------------------------------------------------------------------------ given
class Net(nn.Module):
    """The README's ``Net``: a small classifier of 16 features into 16 classes (fp8-eligible shapes)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        return self.body(x)


def _given() -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)) for _ in range(3)]
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, optimizer, "fp16")
    x, y = loader[0]
    return {"torch": torch, "nn": nn, "F": F, "mixprec": mixprec, "Net": Net, "loader": loader,
            "model": model, "optimizer": optimizer, "opt": optimizer, "mp": mp, "x": x, "y": y,
            "loss_fn": F.cross_entropy, "fp32_model": Net(), "step": 0,
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}


def _needs(code: str) -> None:
    """Skip, naming the extra, where a block imports an optional package that is not installed."""
    for name in sorted(set(re.findall(r"^\s*(?:import|from) (\w+)", code, flags=re.M)) & _OPTIONAL):
        pytest.importorskip(name, reason=f"{name} is not installed (pip install 'mixprec[integrations-test]')")
    if "SummaryWriter" in code:
        pytest.importorskip("tensorboard", reason="tensorboard is not installed")


def _run(block: Block, namespace: dict) -> None:
    if ">>> " in block.code:
        test = doctest.DocTestParser().get_doctest(block.code, namespace, block.id, str(block.page), block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out: list[str] = []
        runner.run(test, out=out.append, clear_globs=False)
        assert runner.failures == 0, "".join(out)
    else:
        exec(compile(block.code, block.id, "exec"), namespace)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block, tmp_path, monkeypatch):
    if block.marker == "skip":
        pytest.skip(block.reason)
    monkeypatch.chdir(tmp_path)                       # blocks write checkpoints and files where they run
    chain = [block]
    page_blocks = [b for b in PYTHON if b.page == block.page]
    k = page_blocks.index(block)
    while chain[0].marker == "continue":              # rerun what the block continues, from its start
        k -= 1
        assert k >= 0, f"{block.id} continues no earlier python block"
        chain.insert(0, page_blocks[k])
    namespace = _given()
    for b in chain[:-1]:
        _needs(b.code)
        _run(b, namespace)
    _needs(block.code)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        _run(block, namespace)
    if block.shown is not None:                       # the page shows what the block prints: it must
        assert printed.getvalue().split() == block.shown.split(), printed.getvalue()


# ------------------------------------------------------------------------------------------ shell
def _make_targets() -> set[str]:
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    return set(phony.group(1).split())


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_commands_exist(block):
    if block.marker == "skip":
        pytest.skip(block.reason)
    from mixprec.lab.cli import _parser
    from mixprec.lab.failure import wants_traceback
    for command in block.commands:
        words = shlex.split(command)
        if words[0] == "mixprec":
            args = _parser().parse_args(wants_traceback(words[1:])[1])
            assert callable(args.handler), command
        elif words[0] == "make":
            assert set(words[1:]) <= _make_targets(), f"{block.id}: {command!r} names no Makefile target"
        else:
            pytest.fail(f"{block.id}: {command!r} is neither a mixprec nor a make command: run it in a test "
                        f"or mark the block <!-- docs-test: skip: REASON -->")


# ------------------------------------------------------------------------------------------ pages
def test_markers_are_spelled_right():
    """A misspelled marker would silently run (or fail) the block it meant to skip."""
    for page in PAGES:
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("<!--") and "docs-test" in line:
                assert _MARKER.search(line), f"{page.name}: bad marker {line!r} (skip: REASON, or continue)"


def test_readme_is_a_front_page_that_links_every_guide_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"(docs/{page.name}" in text, f"the README does not link docs/{page.name}"


def test_every_guide_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, flags=re.M), f"{page.name} is not in mkdocs.yml"


def test_the_recipe_table_is_the_same_in_the_readme_and_the_guide():
    def table(path):
        text = path.read_text()
        start = text.index("| name | weights |")
        return text[start:text.index("\n\n", start)]
    assert table(ROOT / "README.md") == table(ROOT / "docs" / "recipes.md")
    named = set(re.findall(r"`([\w-]+)`", "".join(row.split("|")[1] for row in table(ROOT / "README.md").splitlines())))
    assert named == set(mixprec.RECIPES), "every named recipe has a row, and only those"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install 'mixprec[dev]')")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f",
                          str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "fp8" / "index.html").exists()


SKIPPED = [b for b in PYTHON if b.marker == "skip"]


@pytest.mark.parametrize("block", SKIPPED, ids=[b.id for b in SKIPPED])
def test_a_block_too_big_to_run_imports_only_what_mixprec_has(block):
    """A block the docs test cannot run (torchrun, a GPU) still names only things mixprec exports:
    the distributed example once imported ``local_shard`` from a package that did not have it."""
    imports = re.findall(r"^from (mixprec[\w.]*) import ([\w, ]+)$", block.code, flags=re.M)
    for module, names in imports:
        mod = importlib.import_module(module)
        missing = [n.strip() for n in names.split(",") if not hasattr(mod, n.strip())]
        assert not missing, f"{block.id}: {module} has no {missing}"


def test_install_floors_and_make_tests_extras_are_the_ones_the_build_uses():
    """Issue 37: docs/index.md said torch >= 2.4 while pyproject required 2.13, and the README's `make test`
    line left out the vision-test extra the Makefile adds beside a CUDA torch."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_floor = re.search(r'"torch>=([\d.]+)"', pyproject).group(1)
    python_floor = re.search(r'requires-python = ">=([\d.]+)"', pyproject).group(1)
    index = (ROOT / "docs" / "index.md").read_text()
    assert f"(Python >= {python_floor}, torch >= {torch_floor})" in index
    assert set(re.findall(r"torch >= ([\d.]+)", index)) == {torch_floor}
    makefile = (ROOT / "Makefile").read_text()
    extras = re.findall(r"extras=(?:\$\$extras,)?([\w,-]+)", makefile)     # the test target's extras lines
    assert extras and "vision-test" in extras
    readme_line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                       if line.startswith("make test "))
    for extra in ",".join(extras).split(","):
        assert extra in readme_line, f"README's `make test` line does not name the {extra} extra"


def test_make_compare_runs_the_command_the_readme_shows():
    """Issue 37: `make compare` ran `mixprec compare` (torch's default threads, any device) while the README
    showed `mixprec compare --device cpu --threads 1`: a newcomer's table could not be held against it."""
    makefile = (ROOT / "Makefile").read_text()
    make_line = re.search(r"^compare:.*\n\t\$\(VENV\)/bin/(mixprec compare[^\n]*)$", makefile, re.MULTILINE).group(1)
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"<!-- fig:compare\.mlp\.table -->\n```\n\$ (mixprec compare[^\n]*)\n", readme).group(1)
    assert make_line.strip() == shown.strip()
    assert f"`{shown.strip()}`" in next(line for line in readme.splitlines() if line.startswith("make compare "))
