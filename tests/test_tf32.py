"""TF32 switches: the fp32 recipes set them for their forward and backward and give them back; the
low-precision recipes leave them as the user set them, through either of torch's APIs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.casting.tf32 import fp32_precision

KNOBS = {"matmul": torch.backends.cuda.matmul, "conv": torch.backends.cudnn.conv,
         "rnn": torch.backends.cudnn.rnn}


def legacy_flags() -> tuple[bool, bool] | None:
    """torch's legacy TF32 flags; None where torch refuses to read them (the new API was used since)."""
    try:
        return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    except RuntimeError:
        return None


@pytest.fixture(autouse=True)
def restore_torch_flags():
    """Each test sets torch's global switches its own way: put every one back, the new API's values
    first, then the legacy flags if they could be read before: a legacy flag set in a test and a new
    value restored after it would leave later tests unable to read the legacy flags."""
    saved = {name: k.fp32_precision for name, k in KNOBS.items()}
    saved_global = (torch.backends.fp32_precision, torch.backends.cudnn.fp32_precision)
    legacy = legacy_flags()
    yield
    torch.backends.fp32_precision, torch.backends.cudnn.fp32_precision = saved_global
    for name, k in KNOBS.items():
        k.fp32_precision = saved[name]
    if legacy is not None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
        assert legacy_flags() == legacy


def settings() -> dict[str, str]:
    return {name: k.fp32_precision for name, k in KNOBS.items()}


class _Spy(torch.autograd.Function):
    """Identity that records the switches its forward and its backward ran under."""

    seen: dict[str, dict[str, str]] = {}

    @staticmethod
    def forward(ctx, x):
        _Spy.seen["forward"] = settings()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Spy.seen["backward"] = settings()
        return g


def one_step(recipe: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    with mp.autocast():
        loss = F.mse_loss(model(_Spy.apply(torch.randn(2, 8, requires_grad=True))), torch.zeros(2, 4))
    mp.backward(loss)
    mp.step()


def test_the_fp32_recipe_runs_forward_and_backward_in_ieee_fp32_and_restores_the_users_tf32():
    # Before: the forward only, and through the legacy flags; the backward ran under torch's defaults,
    # which put cuDNN convolutions in TF32: the "fp32" reference was not fp32 on a GPU conv net.
    for k in KNOBS.values():
        k.fp32_precision = "tf32"
    _Spy.seen.clear()
    one_step("fp32")
    ieee = {name: "ieee" for name in KNOBS}
    assert _Spy.seen == {"forward": ieee, "backward": ieee}
    assert settings() == {name: "tf32" for name in KNOBS}


@pytest.mark.parametrize("recipe", ["bf16", "fp16", "bf16-pure"])
def test_low_precision_recipes_train_under_the_new_tf32_api_and_leave_it_as_set(recipe):
    # PyTorch's notes tell users to set TF32 with fp32_precision. mp.autocast() then read the legacy
    # flag, and torch raised "mix of the legacy and new APIs" on every forward, whatever the recipe.
    torch.backends.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = settings()
    _Spy.seen.clear()
    one_step(recipe)
    assert _Spy.seen == {"forward": before, "backward": before}     # as torch.autocast: untouched
    assert settings() == before and torch.backends.fp32_precision == "tf32"


def test_a_user_of_the_legacy_flags_can_still_read_them_after_an_fp32_step():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = False
    one_step("fp32")
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is False


@pytest.mark.parametrize("tf32, inside", [(True, "tf32"), (False, "ieee")])
def test_fp32_precision_sets_every_switch_and_restores_each_on_an_error(tf32, inside):
    # The tf32 recipe needs an Ampere GPU to be built; its switch is this context manager.
    KNOBS["matmul"].fp32_precision, KNOBS["conv"].fp32_precision = "none", "tf32"
    before = settings()
    with pytest.raises(KeyError):
        with fp32_precision(tf32=tf32):
            assert settings() == {name: inside for name in KNOBS}
            raise KeyError("a forward that fails")
    assert settings() == before


def test_mp_autocast_of_the_fp32_recipe_inside_a_compiled_function_does_not_break_the_graph():
    # Dynamo cannot read the fp32_precision switches: inside a traced function the engine leaves them.
    model = nn.Linear(8, 4)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32")

    def forward(x):
        with mp.autocast():
            return model(x).sum()

    explained = torch._dynamo.explain(forward)(torch.randn(2, 8))
    assert explained.graph_break_count == 0, explained.break_reasons
