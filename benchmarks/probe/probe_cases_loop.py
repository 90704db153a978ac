"""The probe's cases for the training loop and the diagnostics: misuse between forward and step
(bare optimizer steps, casts, wrong losses, param groups added late), the engine's state, and the tools
around it (RangeCollector, memory_report, cross_entropy, the C counter's build); see probe_bad_inputs.py
for the outcome rules."""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MixedPrecision

from probe_bad_inputs import (Outcome, add, backward, batch, case, correct, engine, engine_state, model_state,
                              refused, same, tiny, train, warned)

# ----------------------------------------------------------------------------- the loop
def _pure_param_group(recipe: str) -> Outcome:
    mp = engine(recipe)
    extra = nn.Linear(16, 4).to(mp.recipe.param.dtype)
    mp.optimizer.add_param_group({"params": list(extra.parameters())})
    backward(mp)
    return refused(mp.step, "add_param_group", state=lambda: engine_state(mp))


for recipe in ("fp16-pure", "bf16-pure", "bf16-sr"):
    add("loop", f"add_param_group of 16-bit weights after the engine, {recipe}",
        lambda r=recipe: _pure_param_group(r))


@case("loop", "add_param_group of the model's own fp32 weights (fp16)")
def _own_param_group() -> Outcome:
    model = tiny()
    opt = torch.optim.SGD(list(model[0].parameters()), lr=0.1)
    mp = MixedPrecision(model, opt, "fp16")
    opt.add_param_group({"params": list(model[3].parameters())})
    before = model[3].weight.detach().clone()
    train(mp)
    return correct(not torch.equal(before, model[3].weight), "the added group trains")


def _bare_step(recipe: str, opt: str) -> Outcome:
    mp = engine(recipe, opt)
    train(mp)
    backward(mp)
    return refused(mp.optimizer.step, "mp.step()", state=lambda: engine_state(mp))


for recipe, opt in [("fp16", "sgd"), ("fp16", "adamw"), ("fp16", "adamw-fused"), ("fp16-pure", "adamw"),
                    ("bf16-pure", "sgd"), ("bf16-sr", "adamw"), ("bf16,moments=bf16", "adamw")]:
    add("loop", f"optimizer.step() instead of mp.step(), {recipe} {opt}", lambda r=recipe, o=opt: _bare_step(r, o))


@case("loop", "optimizer.step() under bf16 is a plain step")
def _bare_step_bf16() -> Outcome:
    mp = engine("bf16", "sgd")
    backward(mp)
    before = model_state(mp.model)
    mp.optimizer.step()
    return correct(not same(before, model_state(mp.model)), "bf16 has no scale: a bare step is correct")


@case("loop", "loss.backward() instead of mp.backward() under fp16")
def _plain_backward() -> Outcome:
    mp = engine("fp16")
    x, y = batch()
    with mp.autocast():
        F.cross_entropy(mp.model(x), y).backward()
    return refused(mp.step, "mp.backward", state=lambda: engine_state(mp))


@case("loop", "step() without backward")
def _step_no_backward() -> Outcome:
    mp = engine("fp16")
    return refused(mp.step, "backward", state=lambda: engine_state(mp))


@case("loop", "step() twice on one backward")
def _step_twice() -> Outcome:
    mp = engine("fp16", "sgd")
    backward(mp)
    mp.step()
    return refused(mp.step, "backward", state=lambda: engine_state(mp))


for recipe, cast in [("fp16", "half"), ("fp16-pure", "float"), ("bf16", "bfloat16"), ("fp32", "double"),
                     ("bf16-pure", "half")]:
    def _cast_after(r=recipe, c=cast) -> Outcome:
        mp = engine(r, "sgd")
        getattr(mp.model, c)()
        x, y = batch()

        def loop():
            with mp.autocast():
                loss = F.cross_entropy(mp.model(x.to(next(mp.model.parameters()).dtype)).float(), y)
            mp.backward(loss)
            return mp.step()
        return refused(loop, "changed dtype", "model.half()", state=lambda: engine_state(mp))
    add("loop", f"model.{cast}() after building the {recipe} engine", _cast_after)


LOSSES = [   # (what, loss maker given the engine, words)
    ("mp.backward('loss')", lambda mp: "loss", ["tensor"]),
    ("mp.backward(an int tensor)", lambda mp: torch.tensor(3), ["floating point"]),
    ("mp.backward(a per-sample loss)", lambda mp: mp.model(batch()[0]).sum(1), ["single number"]),
    ("mp.backward(loss under no_grad)", lambda mp: _no_grad_loss(mp), ["no_grad"]),
    ("mp.backward(another model's loss)", lambda mp: tiny(3)(batch()[0]).sum(), ["another model"]),
]


def _no_grad_loss(mp):
    with torch.no_grad():
        return mp.model(batch()[0]).sum()


for what, make_loss, words in LOSSES:
    def _bad_loss(m=make_loss, w=words) -> Outcome:
        mp = engine("fp16")
        loss = m(mp)

        def call():
            mp.backward(loss)
            return mp.step()
        return refused(call, *w, state=lambda: engine_state(mp))
    add("loop", what, _bad_loss)


for what, loss, words in [("mp.scale_loss('loss')", "loss", ["tensor"]),
                          ("mp.scale_loss(an int tensor)", torch.tensor(3), ["floating point"])]:
    add("loop", what, lambda l=loss, w=words: refused(lambda: engine("fp16").scale_loss(l), *w))


@case("loop", "every parameter frozen")
def _frozen() -> Outcome:
    mp = engine("fp16")
    for p in mp.model.parameters():
        p.requires_grad_(False)
    return refused(lambda: backward(mp), "requires_grad=False", state=lambda: engine_state(mp))


@case("loop", "forward under torch.autocast(float16), not mp.autocast()")
def _torch_autocast() -> Outcome:
    mp = engine("fp16")
    x, y = batch()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss)
    return correct(warned(rec, "torch.autocast of your own"),
                   "the warning names the user's own torch.autocast (not 'ran in fp32')")


@case("loop", "forward without any autocast under fp16")
def _no_autocast() -> Outcome:
    mp = engine("fp16")
    x, y = batch()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        mp.backward(F.cross_entropy(mp.model(x), y))
    return correct(warned(rec, "mp.autocast()"), "a warning says the forward ran outside mp.autocast()")


@case("loop", "last_overflow without trace_nonfinite")
def _last_overflow() -> Outcome:
    mp = engine("fp16")
    return refused(lambda: mp.last_overflow, "trace_nonfinite=True")


for what, obs, words in [("add_step_observer(object())", object(), ["before_step"]),
                         ("add_step_observer(a function)", lambda e: None, ["before_step"]),
                         ("add_step_observer(None)", None, ["before_step"])]:
    add("loop", what, lambda o=obs, w=words: refused(lambda: engine("fp16").add_step_observer(o), *w))


@case("loop", "install_grad_sync(object())")
def _grad_sync() -> Outcome:
    mp = engine("fp16")
    return refused(lambda: mp.install_grad_sync(object()), "GradSync", state=lambda: engine_state(mp))


STATE_DICTS = [   # engine.load_state_dict with what a user might hand it
    ("mp.load_state_dict({})", lambda mp: {}, ["mixprec state"]),
    ("mp.load_state_dict(None)", lambda mp: None, ["dict"]),
    ("mp.load_state_dict(model.state_dict())", lambda mp: mp.model.state_dict(), ["mixprec state"]),
    ("mp.load_state_dict(another recipe's)", lambda mp: engine("bf16-pure").state_dict(), ["recipe"]),
    ("mp.load_state_dict(scale value a float)", lambda mp: _scale_as_float(mp.state_dict()), ["value"]),
]


def _scale_as_float(state):
    state["loss_scale"]["value"] = 1024.0
    return state


for what, make_state, words in STATE_DICTS:
    def _bad_state(m=make_state, w=words) -> Outcome:
        mp = engine("fp16-pure")
        train(mp)
        s = m(mp)
        return refused(lambda: mp.load_state_dict(s), *w, state=lambda: engine_state(mp))
    add("loop", what, _bad_state)


class _SparseNet(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8, sparse=sparse)
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@case("loop", "sparse embedding gradients under fp16 train as dense ones")
def _sparse() -> Outcome:
    ids, y = torch.randint(0, 20, (16, 5), generator=torch.Generator().manual_seed(0)), torch.arange(16) % 4
    weights = []
    for sparse in (True, False):
        model = _SparseNet(sparse)
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16", clip_grad_norm=0.5)
        for _ in range(2):
            with mp.autocast():
                loss = F.cross_entropy(model(ids), y)
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        weights.append(model_state(model))
    ok = all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0])
    return correct(ok, "sparse and dense embeddings end at the same weights (clipped)")


@case("loop", "bf16-sr fused: a skipped step leaves the rounding noise")
def _sr_skip_twin() -> Outcome:
    def run(skip: bool):
        mp = engine("bf16-sr", "adamw-fused")
        if skip:
            backward(mp)
            next(mp.model.parameters()).grad.fill_(math.inf)
            mp.step()
            mp.zero_grad()
        train(mp, 2)
        return model_state(mp.model)
    return correct(same(run(True), run(False)), "a run that skipped one inf step equals one that never saw it")


@case("loop", "at the scale floor, a fused optimizer warns too")
def _floor_fused() -> Outcome:
    mp = engine("fp16,scale=dynamic(init=1,floor=1)", "adamw-fused")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            backward(mp)
            next(mp.model.parameters()).grad.fill_(math.nan)
            mp.step()
            mp.zero_grad()
    return correct(warned(rec, "floor"), "a warning says the scale sits at its floor")


# ----------------------------------------------------------------------------- diagnostics, helpers
@case("diag", "RangeCollector(model)")
def _collector_model() -> Outcome:
    from mixprec.diagnostics import RangeCollector
    return refused(lambda: RangeCollector(tiny()), "MixedPrecision")


for what, kwargs, words in [("RangeCollector(mp, every=0)", {"every": 0}, ["every"]),
                            ("RangeCollector(mp, every=1.5)", {"every": 1.5}, ["every"]),
                            ("RangeCollector(mp, modules=['nope'])", {"modules": ["nope"]}, ["nope"]),
                            ("RangeCollector(mp, modules='0')", {"modules": "0"}, ["modules"])]:
    def _collector(k=kwargs, w=words) -> Outcome:
        from mixprec.diagnostics import RangeCollector
        mp = engine("fp16")
        return refused(lambda: RangeCollector(mp, **k), *w, state=lambda: engine_state(mp))
    add("diag", what, _collector)


MEMORY = [   # issue 26: memory_report's slips
    ("memory_report(m, 'fp16', (x, y)) without loss_fn", lambda: mixprec.memory_report(tiny(), "fp16", batch()),
     ["loss_fn"]),
    ("memory_report with integer inputs", lambda: mixprec.memory_report(
        tiny(), "fp16", (batch()[1][:, None].expand(-1, 8), batch()[1]), loss_fn=F.cross_entropy), ["float"]),
    ("memory_report(None, ...)", lambda: mixprec.memory_report(None, "fp16", batch()[0]), ["model"]),
    ("memory_report(m, 'fp17', x)", lambda: mixprec.memory_report(tiny(), "fp17", batch()[0]), ["fp17"]),
    ("memory_report(loss_fn='cross_entropy')", lambda: mixprec.memory_report(
        tiny(), "fp16", batch(), loss_fn="cross_entropy"), ["loss_fn"]),
    ("memory_report(optimizer='adamw')", lambda: mixprec.memory_report(
        tiny(), "fp16", batch(), loss_fn=F.cross_entropy, optimizer="adamw"), ["optimizer"]),
    ("memory_report(batch=None)", lambda: mixprec.memory_report(tiny(), "fp16", None), ["batch"]),
    ("memory_report with a wrong input width", lambda: mixprec.memory_report(
        tiny(), "fp16", (torch.randn(4, 9), torch.zeros(4, dtype=torch.long)), loss_fn=F.cross_entropy),
     ["shape"]),
]
for what, call, words in MEMORY:
    add("diag", what, lambda c=call, w=words: refused(c, *w))


@case("diag", "memory_report with loss_fn predicts")
def _memory_ok() -> Outcome:
    r = mixprec.memory_report(tiny(), "fp16-pure", batch(), loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.AdamW(p))
    params = list(tiny().parameters())
    return correct(r.predicted.optimizer == 2 * 4 * sum(p.numel() for p in params) + 4 * len(params),
                   "AdamW's two fp32 moments and its fp32 step counters counted")


CROSS_ENTROPY = [
    ("cross_entropy(int logits)", lambda: mixprec.cross_entropy(torch.ones(4, 3, dtype=torch.long),
                                                                torch.zeros(4, dtype=torch.long)), ["float"]),
    ("cross_entropy(float targets)", lambda: mixprec.cross_entropy(torch.randn(4, 3), torch.zeros(4)),
     ["target"]),
    ("cross_entropy(batch mismatch)", lambda: mixprec.cross_entropy(torch.randn(4, 3),
                                                                    torch.zeros(5, dtype=torch.long)), ["4", "5"]),
    ("cross_entropy(target out of range)", lambda: mixprec.cross_entropy(
        torch.randn(4, 3), torch.full((4,), 7, dtype=torch.long)), ["7"]),
]
for what, call, words in CROSS_ENTROPY:
    add("diag", what, lambda c=call, w=words: refused(c, *w))


@case("diag", "range counter: a $CC that does not resolve warns and falls back")
def _cc_missing() -> Outcome:
    from mixprec.diagnostics import range_native
    old = os.environ.get("CC")
    os.environ["CC"] = "/nonexistent/cc"
    range_native.native_counter.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            fn = range_native.native_counter()
    finally:
        if old is None:
            os.environ.pop("CC")
        else:
            os.environ["CC"] = old
        range_native.native_counter.cache_clear()
    return correct(fn is None and warned(rec, "/nonexistent/cc"), "None, and a warning naming $CC")


@case("diag", "README's distributed import: local_shard")
def _local_shard() -> Outcome:
    from mixprec.distributed import local_shard  # noqa: F401
    return correct(True, "mixprec.distributed exports local_shard")
