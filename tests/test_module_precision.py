"""Per-module precision: a module (and its children) computes in its own precision, in autocast and pure
recipes alike; outputs are handed back where the surroundings need them; typos are caught on the model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, Precision, parse_recipe
from mixprec.casting.model import low_precision_params, module_precisions


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.ln_f = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(self.ln_f(x))


def _capture(module, store, key):
    """Record (input, output) as the module's own forward sees them: inside mixprec's region wrapper,
    after its input cast (hooks run outside the wrapper and would see the caller's dtypes)."""
    cls = type(module)

    def forward(self, x):
        out = cls.forward(self, x)
        store[key] = (x, out)
        return out
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward})


def _engine(model, recipe):
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)


def test_lm_head_fp32_in_a_bf16_autocast_recipe_is_a_manual_fp32_linear():
    model = Tiny()
    mp = _engine(model, "bf16,modules=lm_head:fp32")
    seen = {}
    _capture(model.lm_head, seen, "head")
    _capture(model.blocks[0][0], seen, "b0")
    with mp.autocast():
        model(torch.randn(3, 8))
    x, out = seen["head"]
    assert x.dtype == out.dtype == torch.float32
    assert torch.equal(out, F.linear(x, model.lm_head.weight, model.lm_head.bias))   # no autocast inside
    assert seen["b0"][1].dtype == torch.bfloat16                                     # untouched: bf16


def test_a_bf16_region_in_an_fp32_recipe_hands_fp32_back():
    model = Tiny()
    mp = _engine(model, "params=fp32,compute=fp32,modules=blocks.1:bf16")
    seen = {}
    _capture(model.blocks[1][0], seen, "inner")
    # A hook sees what the region hands back to its caller.
    model.blocks[1].register_forward_hook(lambda m, args, out: seen.__setitem__("block", (args[0], out)))
    _capture(model.blocks[0][0], seen, "other")
    with mp.autocast():
        y = model(torch.randn(3, 8))
    x, inner = seen["inner"]
    lin = model.blocks[1][0]
    assert inner.dtype == torch.bfloat16        # the child runs under the region's autocast
    assert torch.equal(inner, F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()))
    assert seen["block"][1].dtype == torch.float32       # handed back: the fp32 stream needs fp32
    assert seen["other"][1].dtype == torch.float32 and y.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")          # the region's autocast was closed again


def test_pure_recipe_keeps_an_fp32_module_with_fp32_weights_and_masters_the_rest():
    model = Tiny()
    recipe = parse_recipe("bf16-pure,modules=lm_head:fp32")
    assert module_precisions(model, recipe)["lm_head"] is Precision.FP32
    mp = _engine(model, recipe)
    assert model.lm_head.weight.dtype == torch.float32 and model.ln_f.weight.dtype == torch.float32
    assert model.blocks[0][0].weight.dtype == torch.bfloat16
    assert len(mp.master.masters) == 4                    # two linears' weights and biases
    seen = {}
    _capture(model.lm_head, seen, "head")
    with mp.autocast():
        y = model(torch.randn(3, 8))
    x, out = seen["head"]
    assert x.dtype == out.dtype == torch.float32           # fp32 logits, not rounded to bf16 on the way out
    assert torch.equal(out, F.linear(x, model.lm_head.weight, model.lm_head.bias))
    mp.backward(F.cross_entropy(y, torch.tensor([0, 1, 2])))
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert mp.step().grad_norm > 0


def test_rules_override_fp32_modules_and_reach_children():
    model = Tiny()
    recipe = parse_recipe("bf16-pure,modules=LayerNorm:bf16+blocks.0:fp32")
    precisions = module_precisions(model, recipe)
    assert precisions["ln_f"] is Precision.BF16                      # the default norm rule, overridden
    assert precisions["blocks.0.0"] is precisions["blocks.0.1"] is Precision.FP32   # children inherit
    kept = {id(p) for p in model.blocks[0].parameters()}
    assert not kept & {id(p) for p in low_precision_params(model, recipe)}
    _engine(model, recipe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(2, 8)).dtype == torch.float32


def test_a_pattern_matching_no_module_names_the_close_ones():
    with pytest.raises(ValueError, match=r"lm_haed:fp32 matches no module of Tiny; did you mean lm_head"):
        _engine(Tiny(), "bf16,modules=lm_haed:fp32")
    with pytest.raises(ValueError, match=r"with params=bf16 a module runs in fp32"):
        parse_recipe("bf16-pure,modules=lm_head:fp16")


def test_an_fp32_modules_name_matching_no_class_is_refused_before_anything_changes():
    # "fp16-pure,fp32_modules=LayerNrom" matched nothing and cast the norms to fp16 without a word.
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"fp32_modules=LayerNrom matches no module class of Tiny .*did you "
                                         r"mean LayerNorm\?"):
        MixedPrecision(model, opt, "fp16-pure,fp32_modules=LayerNrom")
    assert all(p.dtype == torch.float32 for p in model.parameters())            # nothing was cast
    assert [list(g["params"]) for g in opt.param_groups] == groups              # no master copies wired in
    _engine(Tiny(), "fp16-pure,fp32_modules=LayerNorm+Norm")    # substrings of a class name match
    _engine(Tiny(), "bf16,fp32_modules=LayerNrom")      # fp32_modules applies to pure recipes only


def test_regions_survive_an_exception_in_forward():
    model = Tiny()
    _engine(model, "params=fp32,compute=fp32,modules=lm_head:bf16")
    with pytest.raises(RuntimeError):
        model.lm_head(torch.randn(3, 7))                   # wrong width: the forward raises
    assert not torch.is_autocast_enabled("cpu")            # always_call hook restored the state
    assert model.lm_head(torch.randn(3, 8)).dtype == torch.float32   # still usable, fp32 back out


def test_compare_plan_catches_a_module_typo_before_training():
    from mixprec.lab.compare.run import plan_compare
    with pytest.raises(ValueError, match="did you mean lm_head"):
        plan_compare("gpt", ["bf16", "bf16,modules=lm_haed:fp32"], steps=1, device="cpu")
