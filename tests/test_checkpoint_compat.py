"""Checkpoints on disk outlive the layout of the code that wrote them: the files in tests/data/ckpt-v2/
were written by mixprec before the core was grouped into packages (commit 4f8238f, by
tests/data/make_checkpoints.py); today's mixprec must load them, and write the same payload for the
same run."""

import importlib.util
from pathlib import Path

import pytest
import torch

import mixprec

from conftest import same_nested

DATA = Path(__file__).parent / "data"
_spec = importlib.util.spec_from_file_location("make_checkpoints", DATA / "make_checkpoints.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


@pytest.mark.parametrize("recipe", make.RECIPES)
def test_a_checkpoint_written_before_the_regrouping_loads_and_is_what_today_writes(tmp_path, recipe):
    old = DATA / "ckpt-v2" / f"{recipe}.ckpt"
    new = mixprec.save_checkpoint(tmp_path / "new.ckpt", make.run(recipe))
    old_state, new_state = mixprec.read_checkpoint(old).state, mixprec.read_checkpoint(new).state
    # The RNG streams differ from process to process (Python's own generator is not seeded by the
    # run); everything the run computed must be the same, bit for bit.
    old_state.pop("rng"), new_state.pop("rng")
    assert same_nested(old_state, new_state)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16))
    resumed = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, seed=3)
    mixprec.load_checkpoint(old, resumed)
    assert same_nested(resumed.state_dict(), make.run(recipe).state_dict())
