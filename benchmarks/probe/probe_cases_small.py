"""The probe's issue-33 cases, continued: the fp8 scale's rounding, the doctor's what-if on layers the
fp8 swap cannot take, nvfp4's zero blocks, and scale=per-layer on tuple outputs and Mixtral-style
routers (see probe_bad_inputs.py for the outcome rules)."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import FP8_E4M3, FP8_E5M2, MixedPrecision

from probe_bad_inputs import Outcome, add, correct, refused


# ------------------------------------------------------------- the per-tensor scale, correctly rounded
def _want(amax: torch.Tensor, fmt, margin: int, pow2: bool) -> torch.Tensor:
    q = (fmt.max / amax.double()).clamp(max=2.0**64).float() * 2.0**-margin   # one rounding to fp32
    return torch.exp2(torch.floor(torch.log2(q.double()))).float() if pow2 else q


def _amaxes(seed: int, n: int = 2000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 12).float().clamp(min=1e-30)


def _current(fmt, margin: int, pow2: bool) -> Outcome:
    from mixprec.fp8 import current_scale
    amax = _amaxes(margin + 2 * pow2)
    got = current_scale(amax, fmt, margin=margin, pow2=pow2)
    off = int((got != _want(amax, fmt, margin, pow2)).sum())
    return correct(off == 0, f"all {amax.numel()} scales are fl32(fmax / amax) (one rounding), capped, floored "
                             f"(off: {off})")


def _delayed(fmt) -> Outcome:
    from mixprec.fp8 import delayed_scale
    amax = _amaxes(9, 200)
    got = torch.stack([delayed_scale(torch.stack([a / 3, a, torch.zeros(())]), torch.zeros(()), torch.ones(()),
                                     fmt) for a in amax])
    return correct(torch.equal(got, _want(amax, fmt, 0, False)), "delayed scales from 200 histories are "
                                                                 "fl32(fmax / max(history))")


def _layer_scales(delayed: bool) -> Outcome:
    from mixprec.fp8 import Fp8Config, Fp8Linear
    config = dataclasses.replace(Fp8Config.parse("delayed"), history=1) if delayed else Fp8Config()
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(32, 16), config, "emulate")
    g = torch.Generator().manual_seed(4)
    bad = 0
    for step in range(20):
        x = torch.randn(8, 32, generator=g) * float(torch.exp(torch.randn((), generator=g) * 4))
        layer(x).sum().backward()
        state = layer.fp8_state()
        amax = x.abs().max()
        if not delayed:
            bad += int(not torch.equal(state["input_scale"], _want(amax[None], FP8_E4M3, 0, False)[0]))
    return correct(bad == 0 and torch.isfinite(layer.fp8_state()["input_scale"]).all(),
                   "an fp8 layer's input scale is fl32(448 / amax) at each of 20 steps" if not delayed
                   else "a delayed fp8 layer's scales stay finite over 20 steps of moving amaxes")


def _edge(amax: float, want: float) -> Outcome:
    from mixprec.fp8 import current_scale
    got = float(current_scale(torch.tensor(amax), FP8_E4M3))
    return correct(got == want, f"amax {amax!r} gives scale {want!r} (got {got!r})")


for _f in (FP8_E4M3, FP8_E5M2):
    for _m, _p in ((0, False), (1, False), (0, True), (2, True)):
        add("fp8-scale", f"{_f.name} margin={_m} pow2={_p}: scale = fl32(fmax / amax)",
            lambda f=_f, m=_m, p=_p: _current(f, m, p))
    add("fp8-scale", f"{_f.name}: delayed scale = fl32(fmax / max history)", lambda f=_f: _delayed(f))
add("fp8-scale", "Fp8Linear current: input scale correctly rounded over 20 steps", lambda: _layer_scales(False))
add("fp8-scale", "Fp8Linear delayed: scales finite over 20 steps", lambda: _layer_scales(True))
for _a, _w in ((1e-30, 2.0**64), (0.0, 1.0), (float("inf"), 1.0), (float("nan"), 1.0), (448.0, 1.0),
               (3.0e38, float(_want(torch.tensor([3.0e38]), FP8_E4M3, 0, False))),     # fp32's 3e38
               (7.0, float(torch.tensor(448.0 / 7.0).float()))):
    add("fp8-scale", f"amax {_a!r}: its scale", lambda a=_a, w=_w: _edge(a, w))


# ------------------------------------------------------------ the what-if on layers fp8 cannot take
def _what_if_lines(model: nn.Module, k: int) -> tuple[list[str], object]:
    from mixprec.lab.doctor.render_what_if import model_formats, what_if_lines
    from mixprec.lab.doctor.report import DoctorReport
    from mixprec.lab.doctor.what_if import WhatIfCapture, measure_what_if
    from mixprec.lab.doctor.what_if_report import WhatIfOptions
    torch.manual_seed(1)
    capture = WhatIfCapture(model, max_rows=4096)
    with capture.capturing():
        model(torch.randn(256, k)).square().sum().backward()
    w = measure_what_if(capture, WhatIfOptions(grad_snr=False), step=1)
    report = type("R", (), {"what_if": w})()       # what_if_lines reads report.what_if only
    return what_if_lines(report), model_formats(w)


def _odd(shape: tuple[int, ...], swappable: tuple[bool, ...]) -> Outcome:
    torch.manual_seed(0)
    layers = []
    for a, b in zip(shape, shape[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    lines, (everyone, _) = _what_if_lines(nn.Sequential(*layers[:-1]), shape[0])
    advised = any("--recipe" in line for line in lines)
    if not any(swappable):
        return correct(not advised and "no fp8 recipe can take any" in lines[-1] and everyone is None,
                       "no layer the swap can take: no --recipe advised, the shapes to pad to named")
    if all(swappable):
        return correct(advised and "stay in the base precision under any" not in lines[-1],
                       "every layer swappable: a recipe advised as before")
    return correct("stay in the base precision under any fp8 recipe" in lines[-1]
                   and "pad to" in lines[-1], "the advice counts the swappable layers and names the others")


for _shape, _ok in (((33, 7, 5), (False, False)), ((10, 10), (False,)), ((32, 17), (False,)),
                    ((17, 32), (False,)), ((32, 48, 5), (True, False)), ((7, 32, 48), (False, True)),
                    ((32, 48, 16), (True, True))):
    add("what-if", f"Linear dims {_shape}: advice only over layers fp8 can take",
        lambda s=_shape, o=_ok: _odd(s, o))


# --------------------------------------------------------------------- nvfp4's all-zero blocks
def _zero_block(role: str, axis: int, stochastic: bool, hadamard: bool) -> Outcome:
    from mixprec.fp8 import Fp8Config
    from mixprec.fp8.blocked_linear import blocked_recipe
    from mixprec.fp8.blockscale import fake_quantize_blocked, quantize_blocked, dequantize_blocked, random_hadamard
    how = getattr(blocked_recipe(Fp8Config.parse("nvfp4")), role)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 48, generator=g)
    x[:, 16:32] = 0.0
    x[:16] = 0.0
    zero = x == 0
    if hadamard:
        x = random_hadamard(x, torch.tensor([1.0, -1.0, -1.0, 1.0] * 4), axis)
    noise = torch.randint(0, 2**16, x.shape, generator=g, dtype=torch.int32) if stochastic else None
    q, d = quantize_blocked(x, how, axis, noise=noise)
    deq = dequantize_blocked(q, d, how, axis)[zero]
    fake = fake_quantize_blocked(x, how, axis, noise=noise)[zero]
    ok = all(bool((t == 0).all()) and not bool(torch.signbit(t).any()) for t in (deq, fake))
    return correct(ok, "every value of an all-zero block decodes to +0.0")


def _zero_layer() -> Outcome:
    from mixprec.fp8 import Fp8Config, Fp8Linear
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(32, 16, bias=False), Fp8Config.parse("nvfp4"), "emulate")
    x = torch.zeros(16, 32, requires_grad=True)
    y = layer(x)
    y.backward(torch.zeros_like(y))
    ok = all(bool((t == 0).all()) and not bool(torch.signbit(t).any()) for t in (y, x.grad, layer.weight.grad))
    return correct(ok, "an nvfp4 layer on zeros: output and gradients +0.0")


for _role in ("input", "weight", "grad_output"):
    for _axis in (0, 1):
        for _sr in (False, True):
            for _h in (False, True):
                add("nvfp4-zero", f"{_role} axis {_axis}{' stochastic' if _sr else ''}{' hadamard' if _h else ''}: "
                    "a zero block decodes to +0.0", lambda r=_role, a=_axis, s=_sr, h=_h: _zero_block(r, a, s, h))
add("nvfp4-zero", "Fp8Linear nvfp4 on zeros: +0.0 out and back", _zero_layer)


# ------------------------------------------------------- scale=per-layer: tuples and routers
class _Pair(nn.Module):
    def __init__(self, nested: bool):
        super().__init__()
        self.nested = nested
        self.lin = nn.Linear(8, 24)

    def forward(self, x):
        a, b, c = self.lin(x).chunk(3, -1)
        return ((a, b), c) if self.nested else (a * c, b)


class _Router(nn.Module):
    """HF Mixtral's router: its logits and the top-k weights made from them."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8) * 0.5)

    def forward(self, h):
        logits = F.linear(h, self.weight)
        top, index = torch.topk(F.softmax(logits.float(), dim=-1), 2, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, index


class _Model(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(8, 8)
        if kind in ("pair", "nested"):
            self.body = _Pair(kind == "nested")
        elif kind in ("lstm", "gru"):
            self.body = (nn.LSTM if kind == "lstm" else nn.GRU)(8, 8, batch_first=True)
        else:
            self.gate = _Router()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x)
        if self.kind == "pair":
            a, b = self.body(h)
            h = a * torch.sigmoid(b)
        elif self.kind == "nested":
            (a, b), c = self.body(h)
            h = a * b + c
        elif self.kind in ("lstm", "gru"):
            out, state = self.body(h[:, None].expand(-1, 3, -1))
            last = state[0][0] + state[1][0] if self.kind == "lstm" else state[0]
            h = out[:, -1] * last
        else:
            logits, top, index = self.gate(h)
            out = torch.zeros_like(h)
            for e, expert in enumerate(self.experts):
                rows, slot = torch.where(index == e)
                out = out.index_add(0, rows, expert(h[rows]) * top[rows, slot, None].to(h.dtype))
            aux = logits.float().softmax(-1).mean(0).square().sum() if self.kind == "router-aux" else 0.0
            return self.head(out + h), aux
        return self.head(h), 0.0


def _grads(kind: str, recipe: str, factors: bool) -> tuple[list[dict], list[warnings.WarningMessage], object]:
    torch.manual_seed(0)
    model = _Model(kind)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.05), recipe)
    if factors:
        n = len(mp.loss_scale.layers)
        mp.loss_scale.factors.copy_(2.0 ** (3 * torch.arange(n) % 16).float())
        torch.reciprocal(mp.loss_scale.factors, out=mp.loss_scale.inverses)
    g = torch.Generator().manual_seed(3)
    out = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            with mp.autocast():
                logits, aux = model(x)
                loss = F.cross_entropy(logits, y) + 0.1 * aux
            mp.backward(loss)
            mp.step()
            out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            mp.zero_grad()
    return out, record, mp


def _per_layer_exact(kind: str) -> Outcome:
    ref, _, _ = _grads(kind, "params=fp32,compute=fp32,scale=dynamic", False)
    got, record, mp = _grads(kind, "params=fp32,compute=fp32,scale=per-layer", True)
    exact = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(ref, got))
    router = kind.startswith("router")
    pinned_ok = (list(mp.loss_scale.pinned) == ["gate"]) == router
    noted = any("keeps layer 'gate' at the global scale" in str(r.message) for r in record) == router
    return correct(exact and pinned_ok and noted,
                   "accepted; fp32 gradients with factors up to 2**15 equal scale=dynamic's bit for bit"
                   + (" (the router kept at S, with a warning naming it)" if router else ""))


def _per_layer_fp16(kind: str) -> Outcome:
    got, _, mp = _grads(kind, "fp16,scale=per-layer", False)
    finite = all(torch.isfinite(g).all() for step in got for g in step.values())
    return correct(finite and all(torch.isfinite(p).all() for p in mp.model.parameters()),
                   "fp16 with scale=per-layer trains 2 steps, every gradient and weight finite")


def _still_refused() -> Outcome:
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)

        def forward(self, idx):
            return F.linear(self.mid(self.emb(idx)), self.emb.weight)

    model = Functional()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16,scale=per-layer")

    def go():
        with mp.autocast():
            loss = model(torch.arange(4)).logsumexp(-1).mean()
        mp.backward(loss)
    return refused(go, "emb.weight", "outside its module's forward", "scale=dynamic",
                   state=lambda: [p.grad for p in model.parameters()])


for _k in ("pair", "nested", "lstm", "gru", "router", "router-aux"):
    add("per-layer", f"{_k}: per-layer accepted and exact against scale=dynamic", lambda k=_k: _per_layer_exact(k))
    add("per-layer", f"{_k}: fp16,scale=per-layer trains", lambda k=_k: _per_layer_fp16(k))
add("per-layer", "a parameter used outside its module: still refused, naming it", _still_refused)


def _router_resumes() -> Outcome:
    import tempfile
    from pathlib import Path

    from mixprec import load_checkpoint, save_checkpoint

    def make():
        torch.manual_seed(0)
        model = _Model("router-aux")
        return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "fp16,scale=per-layer")

    def steps(mp, seeds):
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            with mp.autocast():
                logits, aux = mp.model(x)
                loss = F.cross_entropy(logits, y) + 0.1 * aux
            mp.backward(loss)
            mp.step()
            mp.zero_grad()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ck.pt"
        a = make()
        steps(a, range(3))
        save_checkpoint(path, a)
        steps(a, range(3, 6))
        b = make()
        load_checkpoint(path, b)
        steps(b, range(3, 6))
    return correct(all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
                   and list(b.loss_scale.pinned) == ["gate"],
                   "a run with the router kept at S resumes from its checkpoint bit for bit (router kept at S again)")


add("per-layer", "router: fp16 per-layer resumes bit for bit", _router_resumes)
