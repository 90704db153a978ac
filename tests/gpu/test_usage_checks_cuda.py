"""CUDA: issue 15's misuse checks on the fused path: the skip watch reads a device counter without a
host sync (a pinned copy and an event), and still warns after SKIP_WARNING_AFTER skips in a row."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.guards.usage import SKIP_WARNING_AFTER

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")]


def engine(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
    return mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe)


@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_every_step_skipped_warns_on_the_fused_cuda_path_without_a_sync(recipe):
    mp = engine(recipe)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 8, (32,), device="cuda")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(SKIP_WARNING_AFTER + 5):
            with mp.autocast():
                loss = F.cross_entropy(mp.model(x), y) * float("nan")
            mp.backward(loss)
            if step >= 2:           # the pinned buffer exists by now: the step itself must not sync
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                mp.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            mp.zero_grad()
    hits = [w for w in record if "in a row were skipped" in str(w.message)]
    # The count is read a step or two late (when its copy has landed), so it may say 10, 11 or 12.
    assert len(hits) == 1 and mp.skipped_steps == SKIP_WARNING_AFTER + 5


def test_a_refused_load_leaves_cuda_state_bitwise_unchanged(tmp_path):
    mp = engine("bf16-pure")
    other = engine("fp16-pure")
    path = mixprec.save_checkpoint(tmp_path / "ck.pt", other)
    before = [t.clone() for t in mp.model.state_dict().values()] + [m.clone() for m in mp.master.masters]
    with pytest.raises(mixprec.CheckpointError, match="saved under recipe"):
        mixprec.load_checkpoint(path, mp)
    after = list(mp.model.state_dict().values()) + list(mp.master.masters)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
