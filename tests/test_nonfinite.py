"""NaN/Inf origin: overflows planted in a known layer, forward and backward, are named exactly."""

import dataclasses
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import mixprec
from mixprec.guards.nonfinite import NonfiniteTracer


class _TimesInBackward(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class BlowUpGrad(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _TimesInBackward.apply(x, self.factor)


def net(hot_weight: float | None = None, grad_factor: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        embed=nn.Linear(8, 16), act=nn.ReLU(), hidden=nn.Linear(16, 16), blowup=BlowUpGrad(grad_factor),
        act2=nn.ReLU(), head=nn.Linear(16, 4)))
    if hot_weight is not None:
        with torch.no_grad():
            model.hidden.weight.fill_(hot_weight)
    return model


def run_step(model, recipe, x=None):
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                                trace_nonfinite=True)
    x = torch.ones(4, 8) if x is None else x
    with mp.autocast():
        loss = F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
    mp.backward(loss)
    return mp, mp.step()


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure"])
def test_forward_overflow_names_the_layer_and_op(recipe):
    # embed's outputs are O(1) after ReLU; hidden sums 16 of them times 1e4: > 65504 in fp16.
    model = net(hot_weight=1e4)
    with torch.no_grad():
        model.embed.weight.fill_(0.5)
        model.embed.bias.zero_()
    mp, result = run_step(model, recipe)       # x = ones: each embed output is exactly 4.0
    origin = mp.last_overflow
    assert result.skipped
    assert (origin.module, origin.direction, origin.cause) == ("hidden", "forward", "overflow")
    assert origin.op == "aten.addmm.default"
    assert origin.format == "fp16" and origin.format_max == 65504.0
    # addmm(bias, x, W^T): x is exactly 4.0 everywhere, W^T exactly 1e4 (rounded to fp16: 10000).
    ranges = {r.shape: r for r in origin.inputs}
    assert ranges[(4, 16)].max == 4.0 and ranges[(16, 16)].amax == 10000.0
    assert all(r.dtype == "torch.float16" for r in origin.inputs)
    assert "'hidden'" in str(origin) and "65504" in str(origin)


@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure"])
def test_backward_only_overflow_names_the_module_whose_backward_ran(recipe):
    # The forward is clean; blowup's backward multiplies fp16 gradients by 1e9 (static scale 1).
    model = net(grad_factor=1e9)
    recipe = dataclasses.replace(mixprec.get_recipe(recipe), loss_scale=mixprec.LossScaleConfig(kind="static", init=1.0))
    mp, result = run_step(model, recipe)
    origin = mp.last_overflow
    assert result.skipped
    assert (origin.module, origin.direction, origin.op) == ("blowup", "backward", "aten.mul.Tensor")
    assert origin.node is not None and "Backward" in origin.node
    assert origin.cause == "overflow" and origin.loss_scale == 1.0


def test_backward_op_of_a_linear_is_attributed_to_it_under_the_loss_scale():
    # fp16 with its dynamic scale 2**16: head's weight gradient (grad_out^T @ x) overflows first.
    model = net()
    with torch.no_grad():
        model.head.weight.fill_(1.0)
        model.hidden.weight.fill_(0.5)
        model.embed.weight.fill_(0.5)
    mp, result = run_step(model, "fp16", x=torch.full((4, 8), 4.0))
    origin = mp.last_overflow
    assert result.skipped and origin.direction == "backward" and origin.module == "head"
    assert origin.op in ("aten.mm.default", "aten.addmm.default") and origin.loss_scale == 2.0**16
    assert origin.node == "AddmmBackward0"


def test_clean_step_reports_nothing_and_bf16_traces_too():
    for recipe in ("fp16", "bf16", "bf16-pure", "fp32"):
        mp, result = run_step(net(), recipe)
        assert not result.skipped and mp.last_overflow is None


def test_nan_from_finite_inputs_is_called_nan():
    class InfMinusInf(nn.Module):
        def forward(self, x):
            big = x * 1e30 * 1e30          # fp32 overflow to inf: the first non-finite op is this mul
            return big - big
    model = nn.Sequential(nn.Linear(8, 4), InfMinusInf())
    with NonfiniteTracer(model) as tracer:
        model(torch.ones(2, 8)).sum().backward()
    origin = tracer.report()
    assert origin.module == "1" and origin.cause == "overflow" and origin.op == "aten.mul.Tensor"
    # Drop the overflowing ops: a NaN made from finite inputs.
    model2 = nn.Sequential(nn.Linear(8, 4))
    tracer2 = NonfiniteTracer(model2)
    with tracer2:
        out = model2(torch.ones(2, 8)) * 0.0
        (out / out).sum()
    origin = tracer2.report()
    assert origin.cause == "nan" and origin.op == "aten.div.Tensor" and origin.module == "(outside the model)"


def test_inherited_nan_in_the_data():
    model = net()
    x = torch.ones(4, 8)
    x[0, 0] = float("nan")
    mp, result = run_step(model, "bf16", x=x)
    origin = mp.last_overflow
    assert origin.cause == "inherited" and origin.module == "embed" and origin.direction == "forward"


def test_off_installs_nothing():
    model = net()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16")
    hooks = [(m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks)
             for m in model.modules()]
    # fp16 (autocast) installs no hook: its one piece, the root's fp32 output cast, wraps forward.
    assert sum(len(d) for h in hooks for d in h) == 0 and len(mp._hooks) == 1
    assert "forward" in model.__dict__
    with mp.autocast():
        assert _get_current_dispatch_mode() is None
        loss = F.cross_entropy(model(torch.ones(4, 8)), torch.zeros(4, dtype=torch.long))
    mp.backward(loss)
    mp.step()
    with pytest.raises(ValueError, match="trace_nonfinite=True"):
        mp.last_overflow


def test_on_installs_hooks_and_remove_takes_them_off():
    model = net()
    tracer = NonfiniteTracer(model)
    assert all(len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 for m in model.modules())
    tracer.remove()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with pytest.raises(TypeError, match="nn.Module"):
        NonfiniteTracer("model")


def test_evaluation_under_no_grad_is_not_traced():
    model = net()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16",
                                trace_nonfinite=True)
    with torch.no_grad(), mp.autocast():
        model(torch.ones(2, 8))
    assert mp._nonfinite.ops_traced == 0
    with mp.autocast():
        model(torch.ones(2, 8))
    assert mp._nonfinite.ops_traced > 0
