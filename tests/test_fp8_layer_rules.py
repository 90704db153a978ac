"""Different low-precision formats on different layers of one recipe: ``fp8=...(layers=PATTERN:SCALING)``.

Round trips (string, Recipe, checkpoint), the swap building each layer with its own scaling, errors that
name the rule and the layer, and the strongest check of all: a recipe whose rules give every layer the
same scaling trains bit for bit as that scaling's named recipe.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.checkpoint.files import load_checkpoint, save_checkpoint
from mixprec.recipe import Fp8Config, Fp8Scaling, get_recipe, parse_recipe

MIXED = "bf16,fp8=rowwise(skip=4,layers=0:mxfp8+2:current)"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))


def _engine(recipe, model=None):
    model = model or _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # the emulation notice on a CPU
        return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe, seed=0)


def _train(mp, start, steps, fwd=None):
    fwd = fwd or mp.model
    losses = []
    for i in range(start, start + steps):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 32, generator=gen), torch.randn(32, 16, generator=gen)
        with mp.autocast():
            loss = (fwd(x).float() - y).square().mean()
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        losses.append(loss.item())
    return losses


def test_rules_parse_print_back_and_pick_the_first_match():
    cfg = Fp8Config.parse("delayed(history=4,layers=blocks.*.mlp.*:mxfp8+blocks.*:nvfp4,skip=lm_head)")
    assert cfg.layers == (("blocks.*.mlp.*", Fp8Scaling.MXFP8), ("blocks.*", Fp8Scaling.NVFP4))
    assert Fp8Config.parse(str(cfg)) == cfg
    assert cfg.scaling_for("blocks.0.mlp.c_fc") is Fp8Scaling.MXFP8          # the first rule wins
    assert cfg.scaling_for("blocks.0.attn.c_attn") is Fp8Scaling.NVFP4
    assert cfg.scaling_for("wte_proj") is Fp8Scaling.DELAYED
    # The leading scaling's layers keep its options; a rule's take that scaling's defaults.
    assert cfg.for_layer("wte_proj") == Fp8Config(scaling=Fp8Scaling.DELAYED, history=4)
    assert cfg.for_layer("blocks.1.attn.c_proj") == Fp8Config(scaling=Fp8Scaling.NVFP4)
    assert cfg.scalings == (Fp8Scaling.DELAYED, Fp8Scaling.MXFP8, Fp8Scaling.NVFP4)
    recipe = get_recipe(MIXED)
    assert parse_recipe(str(recipe)) == recipe and "layers=0:mxfp8+2:current" in str(recipe)


@pytest.mark.parametrize("text, words", [
    ("rowwise(layers=blocks.0:fp16)", ["unknown scaling 'fp16'", "mxfp8", "skip="]),
    ("rowwise(layers=blocks.0)", ["PATTERN:SCALING"]),
    ("rowwise(layers=a:mxfp8+a:block)", ["given twice"]),
])
def test_bad_rules_say_what_to_write(text, words):
    with pytest.raises(ValueError) as err:
        Fp8Config.parse(text)
    assert all(w in str(err.value) for w in words)


def test_a_rule_that_matches_no_layer_is_refused_before_anything_changes():
    model = _model()
    with pytest.raises(ValueError, match=r"layers=blocks\.\*:mxfp8 matches no nn.Linear.*its linears are: 0, 2, 4"):
        _engine("bf16,fp8=rowwise(layers=blocks.*:mxfp8)", model)
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)      # nothing swapped


def test_each_layer_is_built_with_its_own_scaling_and_the_report_names_it():
    mp = _engine(MIXED)
    assert mp.model[0].fp8_config.scaling is Fp8Scaling.MXFP8 and mp.model[0].blocked is not None
    assert mp.model[2].fp8_config.scaling is Fp8Scaling.CURRENT and mp.model[2].blocked is None
    assert type(mp.model[4]) is nn.Linear
    text = str(mp.fp8_report)
    assert "swapped to mxfp8+current" in text and "mxfp8 e4m3, e8m0 scale per 32" in text


@pytest.mark.parametrize("named, spelled", [("mxfp8", "bf16,fp8=current(layers=*:mxfp8)"),
                                            ("fp8", "bf16,fp8=nvfp4(layers=0:current+2:current+4:current)")])
def test_rules_that_give_every_layer_one_scaling_train_as_its_named_recipe(named, spelled):
    # Bit for bit: the per-layer path builds exactly the layer the named recipe builds.
    assert _train(_engine(spelled), 0, 4) == _train(_engine(named), 0, 4)


def test_a_mixed_recipe_trains_and_differs_from_each_of_its_formats():
    mixed = _train(_engine(MIXED), 0, 6)
    assert all(torch.isfinite(torch.tensor(mixed))) and mixed[-1] < mixed[0]
    for single in ("bf16,fp8=mxfp8(skip=4)", "bf16,fp8=current(skip=4)"):
        assert _train(_engine(single), 0, 6) != mixed


def test_a_mixed_recipe_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    run = _engine(MIXED)
    _train(run, 0, 3)
    save_checkpoint(tmp_path / "ckpt", run)
    straight = _train(run, 3, 3)
    resumed = _engine(MIXED)
    load_checkpoint(tmp_path / "ckpt", resumed)
    assert _train(resumed, 3, 3) == straight
    # The recipe is part of the checkpoint: one with other rules is refused, naming the difference.
    with pytest.raises(ValueError, match="recipe"):
        load_checkpoint(tmp_path / "ckpt", _engine("bf16,fp8=rowwise(skip=4,layers=0:mxfp8)"))


@pytest.mark.slow       # ~20 s on a loaded 2-core CPU: dynamo traces two formats
def test_a_mixed_recipe_compiles_whole_and_trains_as_in_eager():
    eager = _train(_engine(MIXED), 0, 2)
    mp = _engine(MIXED)
    torch._dynamo.reset()
    compiled = _train(mp, 0, 2, fwd=torch.compile(mp.model, fullgraph=True, backend="aot_eager"))
    assert compiled == pytest.approx(eager, rel=1e-6)
