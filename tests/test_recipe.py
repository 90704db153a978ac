"""Recipes: named ones, the string grammar's round trip, and errors that list the valid values."""

import dataclasses
import pickle

import pytest
import torch

from mixprec import LossScaleConfig, Precision, RECIPES, Recipe, get_recipe, parse_recipe
from mixprec.oplists import OpPolicy
from mixprec.formats import FP16
from mixprec.recipe import AmaxAlgorithm, Fp8Backend, Fp8Config, LossScaleKind, Rounding


@pytest.mark.parametrize("name", list(RECIPES))
def test_named_recipe_string_round_trips(name):
    recipe = RECIPES[name]
    assert parse_recipe(str(recipe)) == recipe
    assert parse_recipe(str(recipe)).name == name
    assert pickle.loads(pickle.dumps(recipe)) == recipe


def test_named_recipes_match_the_design_table():
    r = RECIPES
    assert (r["fp32"].param, r["fp32"].compute, r["fp32"].master) == (Precision.FP32, Precision.FP32, None)
    assert r["fp16"].compute is Precision.FP16 and r["fp16"].param is Precision.FP32
    assert r["fp16"].loss_scale.kind == "dynamic" and r["fp16"].loss_scale.init == 2.0**16
    assert r["bf16"].loss_scale.kind == "none" and r["bf16"].autocast
    assert r["fp16-pure"].param is Precision.FP16 and r["fp16-pure"].master is Precision.FP32
    assert r["bf16-pure"].param is Precision.BF16 and r["bf16-pure"].master is Precision.FP32
    assert r["bf16-sr"].master is None and r["bf16-sr"].rounding is Rounding.STOCHASTIC
    assert not r["tf32"].autocast and r["tf32"].compute is Precision.TF32
    assert str(r["fp16-pure"]) == "params=fp16,compute=fp16,master=fp32,scale=dynamic"


@pytest.mark.parametrize("text", [
    "params=fp16,compute=fp16,master=fp32,scale=static:1024",
    "params=fp32,compute=fp16,master=none,scale=dynamic(growth_interval=100,hysteresis=2)",
    "params=fp32,compute=fp16,master=none,scale=dynamic(init=1024,floor=0.0625,ceiling=2**20)",
    "params=bf16,compute=bf16,master=fp32,scale=none,fp32_modules=LayerNorm+Embedding",
    "params=bf16,compute=bf16,master=none,scale=none,fp32_modules=none",
    "params=fp32,compute=fp16,master=none,scale=none",
    "params=fp32,compute=bf16,master=none,scale=none,fp32_ops=layer_norm+softmax,low_ops=bmm",
    "params=fp32,compute=fp16,master=none,scale=dynamic,follow_ops=linear,modules=lm_head:fp32",
    "params=fp32,compute=fp32,master=none,scale=none,low_ops=mse_loss,modules=blocks.*.attn:bf16",
    "params=bf16,compute=bf16,master=fp32,scale=none,fp32_modules=none,modules=LayerNorm:fp32+h?:bf16",
    "params=fp32,compute=bf16,master=none,scale=none,fp8=delayed(history=4,amax=recent,margin=1,pow2=true)",
    "params=bf16,compute=bf16,master=fp32,scale=none,fp8=current(skip=lm_head+blocks.*.attn.*,skip_first=true)",
    "params=fp32,compute=fp16,master=none,scale=dynamic,fp8=current(force=mlp.c_fc,backend=emulate)",
    "params=fp32,compute=bf16,master=none,scale=none,fp8=delayed(skip_last=true,backend=scaled_mm)",
])
def test_custom_recipe_round_trips(text):
    recipe = parse_recipe(text)
    assert str(recipe) == text
    assert parse_recipe(str(recipe)) == recipe


def test_defaults_fill_in_and_aliases_parse():
    r = parse_recipe("params=half,master=none")
    assert r == RECIPES["fp16"].__class__(param=Precision.FP16, compute=Precision.FP16,
                                           loss_scale=LossScaleConfig())
    assert parse_recipe("compute=bfloat16") == RECIPES["bf16"]
    assert parse_recipe("compute=fp16") == RECIPES["fp16"]    # fp16 compute defaults to dynamic scaling
    assert get_recipe(RECIPES["bf16"]) is RECIPES["bf16"]
    assert parse_recipe("params=bf16,compute=bf16,master=fp32").name == "bf16-pure"
    assert parse_recipe("params=fp32,compute=fp16,master=none,scale=dynamic(hysteresis=2)").name is None


def test_dataclasses_replace_varies_a_recipe():
    r = dataclasses.replace(RECIPES["fp16"], loss_scale=LossScaleConfig(kind="static", init=8.0))
    assert str(r) == "params=fp32,compute=fp16,master=none,scale=static:8"
    assert r.label == str(r) and RECIPES["fp16"].label == "fp16"


@pytest.mark.parametrize("text, words", [
    ("fp17", ["unknown recipe", "fp16-pure", "bf16-sr"]),
    ("params=fp16,comptue=fp16", ["unknown recipe key 'comptue'", "compute", "master"]),
    ("params=fp12", ["unknown params 'fp12'", "fp16", "bf16"]),
    ("compute=fp16,scale=sometimes", ["unknown loss scale", "dynamic"]),
    ("compute=fp16,scale=dynamic(speed=2)", ["unknown dynamic loss scale option", "hysteresis"]),
    ("compute=fp16,scale=static", ["static loss scale needs its value"]),
    ("compute=fp16,scale=static:abc", ["must be a number"]),
    ("params=fp16,compute=bf16", ["needs compute=fp16"]),
    ("params=fp32,compute=fp32,master=fp32", ["master copy only makes sense"]),
    ("params=fp16,compute=fp16,master=fp32,rounding=stochastic", ["rounding=stochastic"]),
    ("params=fp16,compute=fp16,rounding=stochastic", ["bf16"]),
    ("params=bf16,rounding=sometimes", ["unknown rounding", "stochastic"]),
    ("params=tf32", ["not a storage format"]),
    ("compute=fp16,compute=bf16", ["given twice"]),
    ("compute=fp16,scale=dynamic(growth=0.5)", ["growth must be > 1"]),
    ("compute=fp16,scale=dynamic(floor=2**20)", ["floor <= init <= ceiling"]),
    ("compute=bf16,fp8=later", ["unknown fp8 scaling 'later'", "current", "delayed"]),
    ("compute=bf16,fp8=delayed(length=4)", ["unknown fp8 option", "history", "margin", "pow2", "skip"]),
    ("compute=bf16,fp8=delayed(amax=mean)", ["unknown fp8 amax 'mean'", "max", "recent"]),
    ("compute=bf16,fp8=delayed(history=0)", ["history must be >= 1"]),
    ("compute=bf16,fp8=delayed(history=many)", ["history must be an integer"]),
    ("compute=bf16,fp8=delayed(pow2=yes)", ["pow2 must be true or false"]),
    ("compute=bf16,fp8=current(history=4)", ["apply to delayed scaling"]),
    ("compute=bf16,fp8=current(backend=cuda)", ["unknown fp8 backend", "scaled_mm", "emulate"]),
    ("compute=bf16,fp8=current(skip=a,force=a)", ["both skipped and forced"]),
    ("compute=bf16,fp8=current(margin=2,margin=3)", ["given twice"]),
])
def test_bad_recipes_name_the_problem(text, words):
    with pytest.raises(ValueError) as info:
        parse_recipe(text)
    for word in words:
        assert word in str(info.value)


def test_fp16_without_scaling_needs_to_be_spelled_out():
    # Left out, the loss scale is the compute precision's default: dynamic for fp16, as in the grammar.
    assert Recipe(compute=Precision.FP16).loss_scale == LossScaleConfig(kind=LossScaleKind.DYNAMIC)
    assert Recipe(compute=Precision.FP16) == parse_recipe("compute=fp16") == get_recipe("fp16")
    assert Recipe(compute=Precision.BF16).loss_scale.kind is LossScaleKind.NONE
    # fp16 without scaling is spelled out, from Python and in the grammar alike, and round-trips.
    unscaled = Recipe(compute=Precision.FP16, loss_scale=LossScaleConfig(kind=LossScaleKind.NONE))
    assert parse_recipe("compute=fp16,scale=none") == unscaled
    assert parse_recipe(str(unscaled)) == unscaled and unscaled != get_recipe("fp16")


def test_recipe_is_built_canonical_by_its_constructor():
    a = Recipe(compute=Precision.BF16, fp32_ops=["softmax", "layer_norm", "softmax"])
    assert a.fp32_ops == ("layer_norm", "softmax")
    assert a == parse_recipe("bf16,fp32_ops=layer_norm+softmax")
    assert dataclasses.replace(a, low_ops=("bmm",)).low_ops == ("bmm",)
    with pytest.raises(TypeError, match="not a string"):
        Recipe(compute=Precision.BF16, fp32_ops="softmax")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.compute = Precision.FP16


def test_closed_sets_are_enums_that_still_compare_to_their_words():
    r = get_recipe("fp8-delayed")
    assert r.fp8.amax is AmaxAlgorithm.MAX and r.fp8.amax == "max"
    assert parse_recipe("compute=bf16,fp8=delayed(amax=recent,backend=emulate)").fp8.backend is Fp8Backend.EMULATE
    assert LossScaleConfig.parse("static:8").kind is LossScaleKind.STATIC
    with pytest.raises(ValueError, match="valid values: max, recent"):
        Fp8Config(amax="largest")
    with pytest.raises(ValueError, match="valid values: none, static, dynamic"):
        LossScaleConfig(kind="adaptive")
    assert Precision.FP16.format is FP16 and Precision.TF32.dtype == torch.float32


def test_fp8_recipes_sit_on_a_bf16_base():
    from mixprec import Fp8Config
    from mixprec.recipe import Fp8Scaling
    fp8, delayed = RECIPES["fp8"], RECIPES["fp8-delayed"]
    assert fp8.compute is Precision.BF16 and fp8.fp8 == Fp8Config() and fp8.fp8.scaling is Fp8Scaling.CURRENT
    assert delayed.fp8.delayed and (delayed.fp8.history, delayed.fp8.amax) == (16, "max")
    assert str(fp8) == "params=fp32,compute=bf16,master=none,scale=none,fp8=current"
    assert parse_recipe("compute=bf16,fp8=current").name == "fp8"
    assert parse_recipe("compute=bf16,fp8=none") == RECIPES["bf16"]
    assert dataclasses.replace(fp8, fp8=None) == RECIPES["bf16"]
    with pytest.raises(TypeError, match="Fp8Config"):
        Recipe(compute=Precision.BF16, fp8="current")


def test_get_recipe_rejects_other_types():
    with pytest.raises(TypeError, match="recipe must be"):
        get_recipe(torch.float16)


def test_op_lists_and_modules_after_a_named_recipe():
    r = parse_recipe("bf16, low_ops=bmm, fp32_ops=softmax+layer_norm+softmax, modules=lm_head:fp32")
    assert r == dataclasses.replace(RECIPES["bf16"], fp32_ops=("layer_norm", "softmax"), low_ops=("bmm",),
                                    modules=(("lm_head", Precision.FP32),))
    assert str(r) == ("params=fp32,compute=bf16,master=none,scale=none,fp32_ops=layer_norm+softmax,"
                      "low_ops=bmm,modules=lm_head:fp32")
    assert parse_recipe(str(r)) == r and r.name is None and r.label == str(r)
    assert r.op_edits == {"layer_norm": OpPolicy.FP32, "softmax": OpPolicy.FP32, "bmm": OpPolicy.LOW}
    # Existing strings keep their meaning: no op edits, no module rules.
    assert parse_recipe("params=bf16,compute=bf16,master=fp32").op_edits == {}


@pytest.mark.parametrize("text, words", [
    ("bf16,fp32_ops=softmx", ["unknown op 'softmx'", "softmax"]),
    ("bf16,params=fp16", ["params=fp16 needs compute=fp16"]),
    ("bf16,modules=lm_head", ["PATTERN:PRECISION"]),
    ("bf16,modules=lm_head:fp12", ["unknown precision for lm_head", "bf16"]),
    ("bf16,modules=lm_head:tf32", ["fp32, fp16 or bf16"]),
    ("bf16-pure,modules=lm_head:fp16", ["with params=bf16"]),
])
def test_op_list_and_module_mistakes_name_the_fix(text, words):
    with pytest.raises(ValueError) as e:
        parse_recipe(text)
    assert all(w in str(e.value) for w in words), str(e.value)


# ------------------------------------------------------------------ issue 15: edits, hints, refusals
@pytest.mark.parametrize("text, expected", [
    ("fp16,scale=static:1024", "params=fp32,compute=fp16,master=none,scale=static:1024"),
    ("fp16-pure,scale=dynamic(hysteresis=2)", "params=fp16,compute=fp16,master=fp32,scale=dynamic(hysteresis=2)"),
    ("fp8-delayed,fp8=delayed(margin=1)", "params=fp32,compute=bf16,master=none,scale=none,fp8=delayed(margin=1)"),
    ("fp8,fp8=current(pow2=true)", "params=fp32,compute=bf16,master=none,scale=none,fp8=current(pow2=true)"),
    ("fp16,compute=bf16", "params=fp32,compute=bf16,master=none,scale=none"),       # dynamic was fp16's default
    ("bf16,compute=fp16", "params=fp32,compute=fp16,master=none,scale=dynamic"),    # and becomes it again
    ("bf16-pure,params=fp16", "params=fp16,compute=fp16,master=fp32,scale=dynamic"),
    ("bf16,modules=lm_head:fp16,scale=dynamic", "params=fp32,compute=bf16,master=none,scale=dynamic,"
                                                "modules=lm_head:fp16"),
])
def test_any_key_edits_a_named_recipe(text, expected):
    r = parse_recipe(text)
    assert str(r) == expected and parse_recipe(str(r)) == r


def test_edits_that_leave_a_named_recipe_give_its_name_back():
    assert parse_recipe("fp16,scale=dynamic").name == "fp16"
    assert parse_recipe("fp16-pure,params=bf16,master=fp32").name == "bf16-pure"
    assert parse_recipe("bf16-pure,params=bf16,rounding=stochastic,master=none").name == "bf16-sr"


@pytest.mark.parametrize("text, hint", [("bf16-pur", "'bf16-pure'"), ("FP16", "'fp16'"),
                                        ("fp8-delay", "'fp8-delayed'"),
                                        ("bf16-pur,scale=dynamic", "'bf16-pure'")])
def test_unknown_recipe_names_say_did_you_mean(text, hint):
    with pytest.raises(ValueError, match="did you mean") as e:
        parse_recipe(text)
    assert hint in str(e.value) and "named recipes" in str(e.value)


@pytest.mark.parametrize("text, words", [
    ("params=fp16", ["params=fp16 without a master copy", "master=fp32", "master=none"]),
    ("params=bf16", ["master=fp32", "rounding=stochastic"]),
    ("compute=fp16,scale=static:1e30", ["above 2**24", "every step is skipped"]),
    ("fp16,scale=static:2**25", ["above 2**24"]),
])
def test_silently_wrong_recipes_are_refused(text, words):
    with pytest.raises(ValueError) as e:
        parse_recipe(text)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("text", ["bf16,modules=2:fp16", "compute=bf16,modules=2:fp16"])
def test_a_module_in_fp16_gets_a_dynamic_scale_unless_scale_none_is_spelled(text):
    # A scale left out is decided by where fp16 runs (gradients below 2**-24 flush to zero without
    # one): a modules rule in fp16 gets dynamic scaling, as the fp16 recipe does, so the recipe is
    # never silently unscaled; scale=none must be spelled to go without.
    r = parse_recipe(text)
    assert r.loss_scale.kind == "dynamic" and str(r).endswith("scale=dynamic,modules=2:fp16")
    assert parse_recipe(text + ",scale=none").loss_scale.kind == "none"


def test_the_refused_recipes_parse_when_spelled_out():
    assert parse_recipe("params=fp16,master=none").master is None
    assert parse_recipe("bf16,modules=2:fp16,scale=none").loss_scale.kind == "none"
    assert parse_recipe("compute=fp16,scale=static:2**24").loss_scale.init == 2.0**24
