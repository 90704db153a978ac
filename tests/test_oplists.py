"""Op lists: autocast's lists as probed, edits that change exactly the targeted ops, and their cost of zero
when nothing is edited."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, parse_recipe
from mixprec.casting.oplists import (OpListMode, OpPolicy, autocast_op_lists, check_op_names, default_policy,
                             op_list_mode)

LOW = torch.bfloat16


def test_probed_cpu_lists_agree_with_what_autocast_does():
    lists = autocast_op_lists("cpu", LOW)
    # Spot checks against torch's autocast_mode.cpp registrations for CPU.
    assert {"mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "conv2d"} <= lists.low
    assert {"nll_loss", "mse_loss", "prod", "cross_entropy_loss", "binary_cross_entropy"} <= lists.fp32
    assert {"cat", "stack"} <= lists.follow
    assert not (lists.low & lists.fp32) and not (lists.low & lists.follow)
    # And against behaviour: run the ops for real and look at the dtypes that come out.
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    pred, target = torch.randn(6).to(LOW), torch.randn(6).to(LOW)
    with torch.autocast("cpu", dtype=LOW):
        assert torch.bmm(a, b).dtype == LOW                                    # low: fp32 in, bf16 out
        assert F.mse_loss(pred, target).dtype == torch.float32                 # fp32: bf16 in, fp32 out
        assert torch.cat([a.flatten(), pred]).dtype == torch.float32           # follow: widest input
        assert torch.softmax(pred, 0).dtype == LOW                             # on no list: follows
    assert default_policy("softmax", "cpu", LOW) is OpPolicy.FOLLOW
    assert default_policy("cross_entropy", "cpu", LOW) is OpPolicy.FP32       # via cross_entropy_loss
    assert autocast_op_lists("cpu", torch.float16).low == lists.low


def _ops(x, w, a, b, pred, target):
    """Independent ops on the same inputs: an edit to one cannot reach another through its output."""
    return {"softmax": F.softmax(x, -1), "layer_norm": F.layer_norm(x, x.shape[-1:]),
            "bmm": torch.bmm(a, b), "linear": F.linear(x, w), "gelu": F.gelu(x),
            "mse_loss": F.mse_loss(pred, target), "matmul": x @ w.t()}


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).to(LOW)             # a 16-bit activation, as in a bf16 model
    w = torch.randn(6, 8, generator=g)                     # an fp32 weight
    a, b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 5, generator=g)
    pred, target = torch.randn(10, generator=g), torch.randn(10, generator=g)
    return x, w, a, b, pred, target


@pytest.mark.parametrize("edits, manual", [
    ({"softmax": OpPolicy.FP32, "layer_norm": OpPolicy.FP32},
     {"softmax": lambda x, w, a, b, p, t: F.softmax(x.float(), -1),
      "layer_norm": lambda x, w, a, b, p, t: F.layer_norm(x.float(), (8,))}),
    ({"mse_loss": OpPolicy.LOW, "gelu": OpPolicy.FP32},
     {"mse_loss": lambda x, w, a, b, p, t: F.mse_loss(p.to(LOW), t.to(LOW)),
      "gelu": lambda x, w, a, b, p, t: F.gelu(x.float())}),
    ({"linear": OpPolicy.FOLLOW, "matmul": OpPolicy.FP32},
     # follow: the widest input dtype; x is bf16 and w fp32, so fp32.
     {"linear": lambda x, w, a, b, p, t: F.linear(x.float(), w),
      "matmul": lambda x, w, a, b, p, t: x.float() @ w.t()}),
])
def test_each_edit_changes_exactly_its_ops_bitwise_as_a_manual_cast(edits, manual):
    inputs = _inputs()
    with torch.autocast("cpu", dtype=LOW):
        plain = _ops(*inputs)
    with torch.autocast("cpu", dtype=LOW), OpListMode(edits, "cpu"):
        edited = _ops(*inputs)
    for op, expected_fn in manual.items():
        expected = expected_fn(*inputs)                    # outside autocast: the manual cast-then-call
        assert edited[op].dtype == expected.dtype != plain[op].dtype, op
        assert torch.equal(edited[op], expected), op
    for op in set(plain) - set(edits):
        assert edited[op].dtype == plain[op].dtype and torch.equal(edited[op], plain[op]), op


def test_edits_act_only_inside_autocast_and_backward_reaches_the_input_dtype():
    x = torch.randn(3, 5).to(LOW).requires_grad_()
    mode = OpListMode({"softmax": OpPolicy.FP32}, "cpu")
    with mode:
        assert torch.softmax(x, -1).dtype == LOW           # no autocast around: nothing to edit
    with torch.autocast("cpu", dtype=LOW), mode:
        y = x.softmax(-1)                                  # the Tensor method is caught too
    assert y.dtype == torch.float32
    (y * torch.arange(5.0)).sum().backward()
    assert x.grad.dtype == LOW                             # the cast is an ordinary .to(): differentiable
    expected = torch.autograd.grad((torch.softmax(x.float(), -1) * torch.arange(5.0)).sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_default_lists_install_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    for recipe in ("bf16", "bf16,low_ops=bmm+linear,fp32_ops=nll_loss"):   # the latter: CPU's defaults
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
        assert mp._op_mode is None
        with mp.autocast():
            assert torch._C._len_torch_function_stack() == 0   # no mode: no per-op Python work
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16,fp32_ops=softmax+bmm")
    assert mp._op_mode is not None and mp._op_mode.edits == {"softmax": OpPolicy.FP32,
                                                             "bmm": OpPolicy.FP32}
    assert op_list_mode({"linear": OpPolicy.LOW}, "cpu") is None


def test_engine_applies_edits_in_its_autocast():
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):                              # (B, T, 8)
            q, k, v = self.qkv(x).split(8, dim=-1)
            att = torch.softmax(q @ k.transpose(1, 2) / 8**0.5, dim=-1)
            self.att_dtype = att.dtype
            return (att @ v).sum()

    model = Attn()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16,fp32_ops=softmax")
    with mp.autocast():
        loss = model(torch.randn(2, 5, 8))
    assert model.att_dtype == torch.float32
    mp.backward(loss)
    assert model.qkv.weight.grad.dtype == torch.float32 and torch.isfinite(model.qkv.weight.grad).all()


def test_unknown_op_names_suggest_close_ones():
    with pytest.raises(ValueError, match=r"unknown op 'softmx' in fp32_ops; did you mean softmax"):
        check_op_names(("softmx",), key="fp32_ops")
    with pytest.raises(ValueError, match=r"'layernorm' in low_ops; did you mean layer_norm"):
        parse_recipe("bf16,low_ops=layernorm")
    with pytest.raises(ValueError, match="both fp32_ops and low_ops"):
        parse_recipe("bf16,fp32_ops=bmm,low_ops=bmm")
    with pytest.raises(ValueError, match="act where autocast runs"):
        parse_recipe("fp32_ops=softmax")


def test_compare_words_keep_edits_with_the_named_recipe_before_them():
    from mixprec.lab.cli_args import recipe_words as _recipe_words
    assert _recipe_words(["fp32,bf16,fp32_ops=softmax,modules=lm_head:fp32", "bf16,low_ops=bmm,fp16"]) == [
        "fp32", "bf16,fp32_ops=softmax,modules=lm_head:fp32", "bf16,low_ops=bmm", "fp16"]


def test_cuda_lists_are_read_without_a_gpu_from_what_the_op_returns():
    # torch's autocast_mode.cpp, CUDA: softmax, log_softmax, sum, prod, cumsum, cumprod and
    # linalg_vector_norm are fp32 by a dtype=float32 argument, not by casting their inputs.
    lists = autocast_op_lists("cuda", torch.float16)
    set_dtype = {"softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod", "linalg_vector_norm"}
    assert set_dtype <= lists.fp32
    assert {"layer_norm", "exp", "pow", "nll_loss", "mse_loss", "upsample_nearest2d"} <= lists.fp32
    assert {"mm", "bmm", "linear", "matmul", "conv2d", "addmm", "baddbmm"} <= lists.low
    assert {"index_put", "addcmul", "scatter_add", "atan2"} <= lists.follow
    assert lists.policy("cat") is OpPolicy.FOLLOW             # not registered on CUDA: follows its inputs
    assert not (lists.low & lists.fp32) and not (lists.fp32 & lists.follow)
    assert default_policy("softmax", "cuda", torch.float16) is OpPolicy.FP32
    # An edit that only restates CUDA's own policy installs nothing.
    assert op_list_mode({"softmax": OpPolicy.FP32, "sum": OpPolicy.FP32}, "cuda", torch.float16) is None


def test_op_lists_of_a_device_torch_cannot_represent_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot read autocast's op lists for device type 'nosuchdevice'"):
        autocast_op_lists("nosuchdevice")


@pytest.mark.parametrize("low", [torch.float32, torch.float64, "bf16"])
def test_op_lists_for_a_dtype_autocast_does_not_lower_to_are_refused(low):
    # float32 answered with three lists no autocast runs (torch.autocast refuses float32 on a CPU).
    with pytest.raises(ValueError, match=r"the dtype autocast lowers to: torch.float16 or torch.bfloat16"):
        autocast_op_lists("cpu", low)


# ---------------------------------------------------------------- ops outside aten (torchvision & co)
@pytest.fixture
def library_ops():
    """Stand-ins for a library that registers its own ops for autocast, as torchvision does with
    torchvision::nms: ``scaled`` (autocast casts its inputs to fp32), ``bmm`` (the name of an aten op,
    cast to fp32) and ``opaque`` (no fake kernel, and a ``Device`` argument the probe cannot make up, so
    the probe cannot call it).
    The probe caches are cleared around the test and the ops dropped after it."""
    import mixprec.casting.oplist_probe as oplist_probe
    import mixprec.casting.oplists as oplists
    lib = torch.library.Library("mixprec_test", "FRAGMENT")
    for name, body in (("scaled", lambda x: x * 2), ("bmm", lambda x: x + 1), ("opaque", lambda x, d: x.to(d))):
        lib.define(f"{name}(Tensor x, Device d) -> Tensor" if name == "opaque" else f"{name}(Tensor x) -> Tensor")
        lib.impl(name, body, "CompositeExplicitAutograd")
        torch.library.register_autocast(f"mixprec_test::{name}", "cpu", torch.float32, lib=lib)
    for name in ("scaled", "bmm"):
        torch.library.register_fake(f"mixprec_test::{name}", lambda x: torch.empty_like(x), lib=lib)
    oplists.autocast_op_lists.cache_clear(), oplist_probe.probed_policies.cache_clear()
    yield
    lib._destroy()
    oplists.autocast_op_lists.cache_clear(), oplist_probe.probed_policies.cache_clear()


def test_ops_outside_aten_are_probed_under_their_qualified_name_or_named_with_a_reason(library_ops):
    # Before: AttributeError "'_OpNamespace' 'aten' object has no attribute 'scaled'" (the probe looked
    # every registered op up in torch.ops.aten).
    lists = autocast_op_lists("cpu", LOW)
    x = torch.ones(3, dtype=LOW)
    with torch.autocast("cpu", dtype=LOW):
        assert torch.ops.mixprec_test.scaled(x).dtype == torch.float32     # what autocast does with it
    assert "mixprec_test::scaled" in lists.fp32 and "mixprec_test::bmm" in lists.fp32
    assert "scaled" not in lists.fp32
    assert "bmm" in lists.low and lists.policy("bmm") is OpPolicy.LOW     # aten's bmm is not shadowed
    assert default_policy("bmm", "cpu", LOW) is OpPolicy.LOW
    assert list(lists.unprobed) == ["mixprec_test::opaque"]
    assert "could not call it on fake tensors" in lists.unprobed["mixprec_test::opaque"]
    assert not any("::" in name for name in lists.low | lists.follow)
    # An edit names torch functions a model calls; a library op is not one of them.
    with pytest.raises(ValueError, match="unknown op 'opaque'"):
        check_op_names(("opaque",), key="fp32_ops")


def test_torchvision_ops_registered_for_autocast_are_listed_or_named():
    """With torchvision's compiled ops loaded (a torchvision built for this torch), each of its ops
    registered for autocast is on a list under ``torchvision::`` or in ``unprobed``, never a crash."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
    registered = {op for op in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
                  if op.startswith("torchvision::")}
    if not registered:
        pytest.skip(f"torchvision {torchvision.__version__} registered no CPU autocast ops here")
    import mixprec.casting.oplist_probe as oplist_probe
    import mixprec.casting.oplists as oplists
    oplists.autocast_op_lists.cache_clear(), oplist_probe.probed_policies.cache_clear()
    lists = autocast_op_lists("cpu", LOW)
    listed = {n for n in lists.low | lists.fp32 | lists.follow if n.startswith("torchvision::")}
    for op in registered:
        assert oplist_probe.list_name(op) in listed or op in lists.unprobed, op
