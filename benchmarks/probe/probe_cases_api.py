"""The probe's cases for recipes and the engine's constructor: recipe strings and config objects, the
weights' dtypes against the recipe, every argument of ``MixedPrecision`` (see probe_bad_inputs.py for the
outcome rules)."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch
from torch import nn

import mixprec
from mixprec import LossScaleConfig, MixedPrecision, Precision, Recipe, get_recipe, parse_recipe
from mixprec.recipe import Fp8Config

from probe_bad_inputs import (CLEAR, Outcome, add, case, correct, engine, engine_state, make_optimizer,
                              model_state, refused, same, tiny, train, warned)

# ----------------------------------------------------------------------------- recipe strings
# (recipe text, words the error must hold). Issue 24 items 1 and 5, and their neighbours.
BAD_RECIPES = [
    ("compute=fp16,scale=static:1e-50", ["below 2**-24"]),
    ("compute=fp16,scale=static:1e-40", ["below 2**-24"]),
    ("compute=fp16,scale=static:1e-30", ["below 2**-24"]),
    ("fp16,scale=static:0", ["positive"]),
    ("fp16,scale=static:-1024", ["positive"]),
    ("fp16,scale=static:nan", ["positive"]),
    ("fp16,scale=static:inf", ["2**24"]),
    ("fp16,scale=static:1e39", ["2**24"]),
    ("fp16,scale=static:abc", ["number"]),
    ("fp16,scale=static", ["needs its value"]),
    ("fp16,scale=dynamic(init=1e-50,floor=1e-50)", ["below 2**-24"]),
    ("fp16,scale=dynamic(init=1e-50)", ["init"]),
    ("fp16,scale=dynamic(floor=0)", ["floor"]),
    ("fp16,scale=dynamic(ceiling=1e39)", ["ceiling", "inf"]),
    ("fp16,scale=dynamic(init=2**30)", ["ceiling"]),
    ("fp16,scale=dynamic(growth=1)", ["growth"]),
    ("fp16,scale=dynamic(growth=1.0000000001)", ["growth"]),
    ("fp16,scale=dynamic(backoff=1)", ["backoff"]),
    ("fp16,scale=dynamic(backoff=0)", ["backoff"]),
    ("fp16,scale=dynamic(growth_interval=1.5)", ["whole number"]),
    ("fp16,scale=dynamic(hysteresis=2.7)", ["whole number"]),
    ("fp16,scale=dynamic(hysteresis=0)", ["hysteresis"]),
    ("fp16,scale=dynamic(growth_interval=-1)", ["growth_interval"]),
    ("fp16,scale=dynamic(hysteresis=3000000000)", ["2**31-1"]),
    ("fp16,scale=dynamic(growth_interval=2**31)", ["2**31-1"]),
    ("fp16,scale=dynamic(growth_interval=nan)", ["whole number"]),
    ("fp16,scale=dynamic(hysteresis=2,hysteresis=3)", ["twice"]),
    ("fp16,scale=dynamic(bogus=1)", ["bogus"]),
    ("fp16,scale=dynamic(init=)", ["init"]),
    ("fp16,scale=dynamic(", ["loss scale"]),
    ("fp16,scale=static:1024,scale=none", ["twice"]),
    ("fp17", ["fp17", "fp16"]),
    ("", ["recipe"]),
    ("params=fp16,compute=fp16", ["master"]),
    ("params=tf32", ["tf32"]),
    ("params=bf16,compute=fp16,master=fp32", ["compute"]),
    ("compute=fp8", ["compute", "fp8"]),
    ("fp16,rounding=stochastic", ["stochastic"]),
    ("fp16,rounding=up", ["rounding"]),
    ("params=fp16,compute=fp16,master=fp16", ["master"]),
    ("bf16,modules=lm head:fp32", ["lm head"]),
    ("bf16,modules=lm_head", ["PATTERN:PRECISION"]),
    ("bf16,modules=lm_head:tf32", ["tf32"]),
    ("bf16,modules=lm_head:fp9", ["fp9"]),
    ("fp32,fp32_ops=softmax", ["autocast"]),
    ("bf16,fp32_ops=not_an_op", ["not_an_op"]),
    ("bf16,fp32_ops=softmax,low_ops=softmax", ["softmax", "both"]),
    ("fp16,bogus=1", ["bogus"]),
    ("bf16-pure,modules=x:fp16", ["fp16"]),
    ("fp8,fp8=bogus", ["bogus"]),
    ("bf16,moments=fp4", ["fp4"]),
    ("bf16,saved=sometimes", ["sometimes"]),
]
for text, words in BAD_RECIPES:
    add("recipe", f"parse_recipe({text!r})", lambda t=text, w=words: refused(lambda: parse_recipe(t), *w))

# (what, call, words): wrong types and values given to the config classes and the parsers directly.
BAD_CONFIGS = [
    ("parse_recipe(None)", lambda: parse_recipe(None), ["NoneType"]),
    ("parse_recipe(16)", lambda: parse_recipe(16), ["int"]),
    ("get_recipe(None)", lambda: get_recipe(None), ["NoneType"]),
    ("get_recipe(b'fp16')", lambda: get_recipe(b"fp16"), ["bytes"]),
    ("get_recipe(Precision.FP16)", lambda: get_recipe(Precision.FP16), ["Precision"]),
    ("LossScaleConfig(init='1024')", lambda: LossScaleConfig(init="1024"), ["init", "number"]),
    ("LossScaleConfig(growth_interval=2.5)", lambda: LossScaleConfig(growth_interval=2.5), ["growth_interval"]),
    ("LossScaleConfig(growth_interval=2000.0)", lambda: LossScaleConfig(growth_interval=2000.0), ["int"]),
    ("LossScaleConfig(hysteresis=True)", lambda: LossScaleConfig(hysteresis=True), ["hysteresis"]),
    ("LossScaleConfig(hysteresis=3000000000)", lambda: LossScaleConfig(hysteresis=3_000_000_000), ["2**31-1"]),
    ("LossScaleConfig(init=1e-50)", lambda: LossScaleConfig(init=1e-50), ["below 2**-24"]),
    ("LossScaleConfig(init=inf)", lambda: LossScaleConfig(init=math.inf), ["inf"]),
    ("LossScaleConfig(kind='bogus')", lambda: LossScaleConfig(kind="bogus"), ["bogus"]),
    ("LossScaleConfig(kind='static', init=1e-45)", lambda: LossScaleConfig(kind="static", init=1e-45),
     ["below 2**-24"]),
    ("LossScaleConfig.parse(1024)", lambda: LossScaleConfig.parse(1024), ["string"]),
    ("Recipe(param='fp16')", lambda: Recipe(param="fp16"), ["Precision"]),
    ("Recipe(loss_scale='dynamic')", lambda: Recipe(compute=Precision.FP16, loss_scale="dynamic"),
     ["LossScaleConfig"]),
    ("Recipe(fp32_ops='softmax')", lambda: Recipe(compute=Precision.BF16, fp32_ops="softmax"), ["tuple"]),
    ("Recipe(modules=[('x', 'fp32')])", lambda: Recipe(compute=Precision.BF16, modules=[("x", "fp32")]),
     ["Precision"]),
    ("Recipe(fp8='current')", lambda: Recipe(compute=Precision.BF16, fp8="current"), ["Fp8Config"]),
    ("Fp8Config.parse(None)", lambda: Fp8Config.parse(None), ["NoneType"]),
]
for what, call, words in BAD_CONFIGS:
    add("recipe", what, lambda c=call, w=words: refused(c, *w))


@case("recipe", "bf16,modules=0:fp16 takes a dynamic scale (docs/recipes.md)")
def _bf16_module_fp16() -> Outcome:
    r = parse_recipe("bf16,modules=0:fp16")
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "recipes.md")).read()
    return correct(r.loss_scale.kind == "dynamic" and "modules=lm_head:fp16` is" in docs
                   and "scale=dynamic,modules=lm_head:fp16" in docs,
                   "fp16 anywhere gets the dynamic scale, and docs/recipes.md says so")


@case("recipe", "dynamic(growth_interval=2e3) is the count 2000")
def _growth_interval_2e3() -> Outcome:
    r = parse_recipe("fp16,scale=dynamic(growth_interval=2e3)")
    return correct(r.loss_scale.growth_interval == 2000 and isinstance(r.loss_scale.growth_interval, int),
                   "a whole float spelling of a count is that count, an int")


@case("recipe", "static:2**-24 (the smallest scale) is accepted exactly")
def _static_min() -> Outcome:
    r = parse_recipe("fp16,scale=static:2**-24")
    mp = engine(r)
    return correct(mp.scale == 2.0**-24, "the scale fp32 holds is 2**-24 exactly")


# ----------------------------------------------------------------------------- engine constructor
def _refused_engine(recipe, model_fn, *words, opt="adamw", **kwargs) -> Outcome:
    model = model_fn()
    optimizer = make_optimizer(opt, model.parameters())
    params = [list(g["params"]) for g in optimizer.param_groups]

    def state():
        return model_state(model), [[id(p) for p in g["params"]] for g in optimizer.param_groups]
    outcome = refused(lambda: MixedPrecision(model, optimizer, recipe, **kwargs), *words, state=state)
    if outcome.kind == CLEAR and [list(g["params"]) for g in optimizer.param_groups] != params:
        return Outcome("partial change", "refused, but the optimizer's parameters were replaced")
    return outcome


DTYPE_MISMATCH = [   # issue 24 item 2: a model already in 16 bits under an autocast recipe, fp64 models
    ("fp16", torch.float16, ["float16", "fp16-pure"]),
    ("bf16", torch.bfloat16, ["bfloat16", "bf16-pure"]),
    ("bf16", torch.float16, ["float16"]),
    ("fp16", torch.bfloat16, ["bfloat16"]),
    ("fp16", torch.float64, ["float64"]),
    ("bf16", torch.float64, ["float64"]),
    ("fp32", torch.float16, ["float16"]),
    ("fp16-pure", torch.bfloat16, ["bfloat16"]),
    ("bf16-pure", torch.float16, ["float16"]),
    ("bf16-sr", torch.float16, ["float16"]),
    ("fp8", torch.bfloat16, ["bfloat16"]),
]
for recipe, dtype, words in DTYPE_MISMATCH:
    add("engine", f"{str(dtype)[6:]} model under {recipe}",
        lambda r=recipe, d=dtype, w=words: _refused_engine(r, lambda: tiny(dtype=d), *w))


@case("engine", "fp16-pure norm kept fp32 but given fp16")
def _pure_norm_fp16() -> Outcome:
    def model():
        m = tiny()
        m[1].half()
        return m
    return _refused_engine("fp16-pure", model, "float16")


@case("engine", "fp16 model under fp16-pure: masters are exact upcasts")
def _pure_model_already_16() -> Outcome:
    model = tiny()
    model[0].half(), model[3].half()
    mp = engine("fp16-pure", model=model)
    exact = all(torch.equal(m, p.float()) for p, m in zip(mp.master.model_params, mp.master.masters))
    train(mp)
    return correct(exact and all(torch.isfinite(p).all() for p in model.parameters()),
                   "masters equal the fp16 weights upcast, and it trains")


BAD_ARGS = [   # (what, model, optimizer-or-None for default, kwargs, words)
    ("model=None", lambda: None, "adamw", {}, ["model", "NoneType"]),
    ("model=a function", lambda: tiny, "adamw", {}, ["model", "function"]),
    ("recipe=None", tiny, "adamw", {"recipe": None}, ["recipe", "NoneType"]),
    ("recipe=16", tiny, "adamw", {"recipe": 16}, ["recipe", "int"]),
    ("recipe='fp17'", tiny, "adamw", {"recipe": "fp17"}, ["fp17"]),
    ("recipe=tf32 on cpu", tiny, "adamw", {"recipe": "tf32"}, ["tf32", "cpu"]),
    ("clip_grad_norm='1.0'", tiny, "adamw", {"clip_grad_norm": "1.0"}, ["clip_grad_norm", "str"]),
    ("clip_grad_norm=0", tiny, "adamw", {"clip_grad_norm": 0}, ["clip_grad_norm", "positive"]),
    ("clip_grad_norm=-1", tiny, "adamw", {"clip_grad_norm": -1.0}, ["clip_grad_norm", "positive"]),
    ("clip_grad_norm=nan", tiny, "adamw", {"clip_grad_norm": math.nan}, ["clip_grad_norm"]),
    ("clip_grad_norm=True", tiny, "adamw", {"clip_grad_norm": True}, ["clip_grad_norm"]),
    ("clip_grad_norm=tensor(1.)", tiny, "adamw", {"clip_grad_norm": torch.tensor(1.0)}, ["clip_grad_norm"]),
    ("seed='abc' under bf16-sr", tiny, "adamw", {"recipe": "bf16-sr", "seed": "abc"}, ["seed"]),
    ("seed=1.5 under bf16-sr", tiny, "adamw", {"recipe": "bf16-sr", "seed": 1.5}, ["seed"]),
    ("seed=None under bf16-sr", tiny, "adamw", {"recipe": "bf16-sr", "seed": None}, ["seed"]),
    ("seed=True under bf16-sr", tiny, "adamw", {"recipe": "bf16-sr", "seed": True}, ["seed"]),
    ("seed='abc' under fp16", tiny, "adamw", {"seed": "abc"}, ["seed"]),
    ("seed='abc' under bf16,moments=bf16-sr", tiny, "adamw", {"recipe": "bf16,moments=bf16-sr", "seed": "abc"},
     ["seed"]),
    ("fp8_filter=True", tiny, "adamw", {"recipe": "fp8", "fp8_filter": True}, ["fp8_filter"]),
    ("fp8_filter under fp16", tiny, "adamw", {"fp8_filter": lambda n, m: True}, ["fp8_filter", "fp8"]),
    ("trace_nonfinite='no'", tiny, "adamw", {"trace_nonfinite": "no"}, ["trace_nonfinite"]),
    ("trace_nonfinite=1", tiny, "adamw", {"trace_nonfinite": 1}, ["trace_nonfinite"]),
    ("process_group='bogus'", tiny, "adamw", {"process_group": "bogus"}, ["process_group", "bogus"]),
    ("process_group=0", tiny, "adamw", {"process_group": 0}, ["process_group"]),
    ("fp16-pure,fp32_modules=LayerNrom", tiny, "adamw", {"recipe": "fp16-pure,fp32_modules=LayerNrom"},
     ["LayerNrom"]),
    ("bf16,modules=lm_haed:fp32", tiny, "adamw", {"recipe": "bf16,modules=lm_haed:fp32"}, ["lm_haed"]),
    ("fp8=current(skip=lm_haed)", tiny, "adamw", {"recipe": "fp8,fp8=current(skip=lm_haed)"}, ["lm_haed"]),
]


def _bad_arg(model_fn, opt, kwargs, words) -> Outcome:
    kwargs = dict(kwargs)
    recipe = kwargs.pop("recipe", "fp16")
    model = model_fn()
    if not isinstance(model, nn.Module):
        return refused(lambda: MixedPrecision(model, make_optimizer(opt, tiny().parameters()), recipe,
                                              **kwargs), *words)
    return _refused_engine(recipe, lambda: model, *words, opt=opt, **kwargs)


for what, model_fn, opt, kwargs, words in BAD_ARGS:
    add("engine", what, lambda m=model_fn, o=opt, k=kwargs, w=words: _bad_arg(m, o, k, w))


def _seed_twins(recipe: str, seed: int, alias: int) -> Outcome:
    # Any int seeds the noise, taken modulo 2**64 (stochastic_rounding.RoundingNoise): -1 is 2**64-1.
    runs = []
    for s in (seed, alias):
        mp = engine(recipe, seed=s)
        train(mp, 2)
        runs.append(model_state(mp.model))
    return correct(same(*runs), f"seed={seed} trains, as seed={alias} (the seed is taken modulo 2**64)")


for recipe in ("bf16-sr", "bf16,moments=bf16-sr"):
    add("engine", f"seed=-1 under {recipe}", lambda r=recipe: _seed_twins(r, -1, 2**64 - 1))
    add("engine", f"seed=2**70 under {recipe}", lambda r=recipe: _seed_twins(r, 2**70, 2**70 % 2**64))


@case("engine", "optimizer=None")
def _optimizer_none() -> Outcome:
    return refused(lambda: MixedPrecision(tiny(), None, "fp16"), "optimizer", "NoneType")


@case("engine", "optimizer=a list of parameters")
def _optimizer_list() -> Outcome:
    model = tiny()
    return refused(lambda: MixedPrecision(model, list(model.parameters()), "fp16"), "optimizer", "list")


@case("engine", "optimizer of another model")
def _foreign_optimizer() -> Outcome:
    model, other = tiny(), tiny(1)
    return refused(lambda: MixedPrecision(model, torch.optim.SGD(other.parameters(), lr=0.1), "fp16"),
                   "optimizer", "Sequential")


@case("engine", "model without parameters")
def _no_params() -> Outcome:
    return refused(lambda: MixedPrecision(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1),
                                          "fp16"), "no parameters")


@case("engine", "integer parameter in the model")
def _int_param() -> Outcome:
    def model():
        m = tiny()
        m.register_parameter("count", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
        return m
    return _refused_engine("fp16", model, "floating point")


@case("engine", "second engine on the same fp16-pure model")
def _second_engine() -> Outcome:
    mp = engine("fp16-pure")
    return refused(lambda: MixedPrecision(mp.model, mp.optimizer, "fp16-pure"), "engine",
                   state=lambda: engine_state(mp))


@case("engine", "clip_grad_norm=inf is no clipping")
def _clip_inf() -> Outcome:
    a, b = engine("fp16", clip_grad_norm=math.inf), engine("fp16")
    train(a, 2), train(b, 2)
    return correct(same(model_state(a.model), model_state(b.model)), "weights equal the unclipped run's")


@case("engine", "clip_grad_norm=np.float32(1) is 1.0")
def _clip_numpy() -> Outcome:
    a, b = engine("fp16", clip_grad_norm=np.float32(0.01)), engine("fp16", clip_grad_norm=0.01)
    train(a, 2), train(b, 2)
    return correct(same(model_state(a.model), model_state(b.model)), "weights equal clip_grad_norm=0.01's")


@case("engine", "fp8 recipe on a model with no linear warns")
def _fp8_no_linear() -> Outcome:
    model = nn.Sequential(nn.Conv1d(8, 8, 1), nn.ReLU())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    return correct(warned(rec, "fp8"), "a warning says no layer runs in fp8")


@case("engine", "fp8 recipe on linears fp8 cannot take warns")
def _fp8_ineligible() -> Outcome:
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    return correct(warned(rec, "fp8"), "a warning says no layer runs in fp8, and why")


SUPPORTS = [
    ("supports(16, 'cpu')", lambda: mixprec.supports(16, "cpu"), ["Recipe", "int"]),
    ("supports('fp16', 0)", lambda: mixprec.supports("fp16", 0), ["device", "int"]),
    ("supports('fp16', 'gpu')", lambda: mixprec.supports("fp16", "gpu"), ["gpu"]),
    ("supports('fp17', 'cpu')", lambda: mixprec.supports("fp17", "cpu"), ["fp17"]),
    ("supports(None, 'cpu')", lambda: mixprec.supports(None, "cpu"), ["NoneType"]),
    ("get_format('fp17')", lambda: mixprec.get_format("fp17"), ["fp17"]),
    ("get_format(None)", lambda: mixprec.get_format(None), ["NoneType"]),
    ("autocast_op_lists('tpu')", lambda: mixprec.autocast_op_lists("tpu"), ["tpu"]),
    ("autocast_op_lists('cpu', torch.float32)", lambda: mixprec.autocast_op_lists("cpu", torch.float32),
     ["float32"]),
]
for what, call, words in SUPPORTS:
    add("engine", what, lambda c=call, w=words: refused(c, *w))


@case("engine", "supports('fp16', 'cpu') with strings answers")
def _supports_strings() -> Outcome:
    s = mixprec.supports("fp16", "cpu")
    return correct(s.ok is True and not mixprec.supports("tf32", "cpu").ok, "fp16 runs on the CPU, tf32 not")


# ----------------------------------------------------------------------------- the regrouped core (issue 52)
def _fresh_import(name: str):
    """Import ``name`` as a user's first import of it would, warnings recorded."""
    import importlib
    import sys
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, record


@case("layout", "import mixprec.master (a path from before the regrouping)")
def _old_module_path() -> Outcome:
    import mixprec.update.master as new
    old, record = _fresh_import("mixprec.master")
    return correct(old is new and warned(record, "mixprec.master moved to mixprec.update.master"),
                   "the old path gives the module at its new home, with a DeprecationWarning naming it")


@case("layout", "from mixprec.grad_sync import GradSync (an old path, a name from it)")
def _old_module_name() -> Outcome:
    from mixprec.step.grad_sync import GradSync
    old, record = _fresh_import("mixprec.grad_sync")
    return correct(old.GradSync is GradSync and warned(record, "mixprec.step.grad_sync"),
                   "the name is the same object, and the warning says where it lives now")


@case("layout", "import mixprec.no_such_module")
def _no_such_module() -> Outcome:
    try:
        _fresh_import("mixprec.no_such_module")
    except ModuleNotFoundError as e:
        return correct("mixprec.no_such_module" in str(e), "Python's own ModuleNotFoundError, naming it")
    return correct(False, "an unknown module is not found (the old-path finder answers only for moved ones)")


@case("layout", "from mixprec.checkpoint import no_such_name")
def _checkpoint_no_such_name() -> Outcome:
    import mixprec.checkpoint
    try:
        exec("from mixprec.checkpoint import no_such_name", {})    # as a user's line would spell it
    except ImportError as e:
        return correct("no_such_name" in str(e) and "mixprec.checkpoint" in str(e),
                       "Python's ImportError names the name and the package (its lazy exports answer only "
                       "for their own names)")
    return correct(False, "an unknown name is refused")


@case("layout", "mixprec.checkpoint.use_mixprec_read_checkpoint (the name checkpoints on disk spell)")
def _checkpoint_trap_name() -> Outcome:
    import mixprec.checkpoint
    fn = mixprec.checkpoint.use_mixprec_read_checkpoint
    allowed = (fn, "mixprec.checkpoint.use_mixprec_read_checkpoint") in torch.serialization.get_safe_globals()
    return correct(allowed, "it resolves in the package and torch.load's allowlist holds it under that name")
