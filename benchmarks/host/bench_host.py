"""Host overhead per training step: every recipe against the torch.amp loop doing the same thing.

On a GPU a small model is host-bound: a step takes as long as Python takes to launch it. This script
measures that host work on a model whose compute is negligible (3 linears 64 wide, batch 8, fused AdamW)
in two ways:

- **calls per step**, deterministic: the Python function calls and the C calls (builtins, torch ops
  called from Python) that one whole step (forward, backward, step, zero_grad) makes, counted with
  ``sys.setprofile``. They do not depend on the machine's load, so a test can pin them
  (tests/test_host_calls.py);
- **time ratios**, interleaved pairs (A, B, then B, A, ...), median of the per-pair ratios mixprec /
  torch.amp: below 1 means mixprec is faster.

Each recipe's baseline is the torch.amp loop that does the same thing: ``bf16`` against autocast bf16 +
fused AdamW; ``fp16`` against autocast fp16 + GradScaler (``unscale_`` before a clip); the pure,
rounding and fp8 recipes against torch.amp bf16 (fp16-pure against fp16 + GradScaler). With a clip,
the torch.amp loop calls ``clip_grad_norm_(foreach=True)``. ``--profile`` prints where each recipe's
calls go (calls per step by function), the table HISTORY.md keeps.

``--torchao`` adds fp8 (per-tensor current scaling) against torchao's own fp8 training of the same
model (``convert_to_float8_training``: per-tensor dynamic scaling, the same formats), where torchao is
installed.

On CUDA (``--device cuda``) the same tiny model is also timed captured: mixprec with a compiled model
and ``mp.compile_step(mode="reduce-overhead")`` (one CUDA-graph replay for the step; also the model
or the step alone in CUDA graphs) against torch.amp's loop with ``torch.compile(model,
mode="reduce-overhead")`` and a compiled fused AdamW step; fp8 also with its casts fused
(fp8/fused.py's compiled kernels instead of the default eager ones). ``--captured`` runs these variants on a CPU too.

Usage: python benchmarks/host/bench_host.py [--recipes bf16,fp16,...] [--clips none,1.0] [--pairs 200]
       [--no-time] [--profile] [--trace] [--guarded] [--torchao] [--captured] [--device cpu|cuda]
       [--threads 1]
On a GPU (a few minutes, mostly compiling):
       python benchmarks/host/bench_host.py --device cuda --recipes bf16,fp16,bf16-pure --clips none --pairs 200
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

WIDTH, BATCH, CLASSES = 64, 8, 16
RECIPES = ["bf16", "fp16", "bf16-pure", "fp16-pure", "bf16-sr", "bf16-kahan", "fp8"]


def tiny_model(device) -> nn.Module:
    """3 linears 64 wide (the last to 16 classes: every one fp8-eligible), the same weights each call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, CLASSES)).to(device)


def batch(device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, WIDTH, generator=g).to(device),
            torch.randint(0, CLASSES, (BATCH,), generator=g).to(device))


def baseline_dtype(recipe: str) -> torch.dtype:
    """The torch.amp loop a recipe is measured against: fp16 compute (with a GradScaler) or bf16."""
    return torch.float16 if mixprec.get_recipe(recipe).compute is mixprec.Precision.FP16 else torch.bfloat16


def mixprec_step(recipe: str, clip: float | None, device, compiled: bool = False,
                 grads_to_none: bool | None = None, *, model_mode: str | None = None,
                 step_mode: str | None = None, mark: bool = False,
                 fused_casts: bool | None = None) -> Callable[[], None]:
    """One whole mixprec step on the tiny model.

    ``compiled``: compiled model + compiled step, both ``mode="reduce-overhead"`` on CUDA. Or each
    apart: ``model_mode`` / ``step_mode`` (``"default"`` or ``"reduce-overhead"``; None: eager).
    ``grads_to_none``: ``zero_grad(set_to_none=...)`` (default True: with the model in CUDA graphs,
    kept gradients are outputs of its graph that the next replay overwrites). ``mark``:
    ``torch.compiler.cudagraph_mark_step_begin()`` before each step. ``fused_casts``: fp8's compiled
    cast kernels on (True) or off (False) where the layers would use them (None: as built)."""
    model = tiny_model(device)
    x, y = batch(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # fp8 emulated on a CPU says so once; not what is measured
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                    recipe, clip_grad_norm=clip)
    if fused_casts is not None:
        for m in model.modules():
            if hasattr(m, "fused_casts"):
                m.fused_casts = fused_casts
    if compiled:
        model_mode = step_mode = "reduce-overhead" if device.type == "cuda" else "default"
    forward = model
    if step_mode is not None:
        mp.compile_step(**({} if step_mode == "default" else {"mode": step_mode}))
    if model_mode is not None:
        forward = torch.compile(model, **({} if model_mode == "default" else {"mode": model_mode}))
    to_none = True if grads_to_none is None else grads_to_none
    mark_step = torch.compiler.cudagraph_mark_step_begin if mark else None

    def step() -> None:
        if mark_step is not None:
            mark_step()
        with mp.autocast():
            loss = F.cross_entropy(forward(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad(set_to_none=to_none)
    return step


def amp_step(dtype: torch.dtype, clip: float | None, device, compiled: bool = False,
             guarded: bool = False, mark: bool = False) -> Callable[[], None]:
    """The hand-written torch.amp loop: autocast, (GradScaler for fp16), clip_grad_norm_, fused AdamW.

    ``guarded`` (bf16, no clip): the loop also skips a step whose gradients hold an inf or NaN, as
    mixprec's bf16 does and torch.amp's bf16 loop does not: ``get_total_norm`` of the gradients, then
    ``optimizer.step()`` only where it is finite (a host read: free on a CPU, a sync on a GPU).
    ``compiled``: the model (and bf16's optimizer step) under ``torch.compile``, ``reduce-overhead`` on
    CUDA, gradients set to None at each zero_grad (kept, they would be outputs of the model's CUDA
    graph that its next replay overwrites); ``mark``: ``cudagraph_mark_step_begin()`` each step."""
    model = tiny_model(device)
    x, y = batch(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    params = list(model.parameters())
    forward = model
    opt_step = opt.step
    if compiled:
        mode = "reduce-overhead" if device.type == "cuda" else None
        forward = torch.compile(model, mode=mode)
        if scaler is None:
            opt_step = torch.compile(opt.step, mode=mode)

    mark_step = torch.compiler.cudagraph_mark_step_begin if mark else None

    def step() -> None:
        if mark_step is not None:
            mark_step()
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(forward(x), y)
        if scaler is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            if not guarded or torch.nn.utils.get_total_norm([p.grad for p in params],
                                                             foreach=True).isfinite():
                opt_step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def torchao_step(clip: float | None, device) -> Callable[[], None] | None:
    """torchao's fp8 training on the same loop: ``convert_to_float8_training`` (its default: per-tensor
    dynamic scaling, e4m3 forward, e5m2 output gradients: mixprec's ``fp8``) under bf16 autocast, fused
    AdamW, ``clip_grad_norm_`` with a clip. None where torchao is not installed."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    model = tiny_model(device)
    convert_to_float8_training(model)
    x, y = batch(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    params = list(model.parameters())

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        opt.zero_grad()
    return step


class CallCounter:
    """Counts ``sys.setprofile`` events while active: Python function calls and C calls."""

    def __init__(self) -> None:
        self.python = 0
        self.c = 0

    def _hook(self, frame, event, arg) -> None:
        if event == "call":
            self.python += 1
        elif event == "c_call":
            self.c += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self.python -= 1    # this __exit__
        self.c -= 1         # and its setprofile(None) call

    @property
    def total(self) -> int:
        return self.python + self.c


def count_calls(step: Callable[[], None], warmup: int = 3) -> CallCounter:
    """The calls one step makes after ``warmup`` steps (optimizer state, lazy first-step work).

    The garbage collector is collected before and paused during the counted step: a collection that
    happens to fall in it runs other objects' finalizers and weakref callbacks (12 calls once, after
    other tests had run in the same process), which are not the step's calls."""
    for _ in range(warmup):
        step()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with CallCounter() as counter:
            step()
    finally:
        if was_enabled:
            gc.enable()
    return counter


def profile_calls(step: Callable[[], None], top: int = 14, warmup: int = 3) -> list[tuple[int, str]]:
    """(calls, where) for one step: each call (Python or C) is charged to the innermost mixprec function
    on the stack when it was made ("outside mixprec": the loop itself, torch's own code), so the table
    says which of mixprec's functions makes the calls, itself or through what it calls. Deterministic."""
    for _ in range(warmup):
        step()
    counts: collections.Counter[str] = collections.Counter()

    def hook(frame, event, arg) -> None:
        if event not in ("call", "c_call"):
            return
        f = frame if event == "c_call" else frame.f_back
        while f is not None and "/mixprec/" not in f.f_code.co_filename:
            f = f.f_back
        if f is None:
            counts["outside mixprec"] += 1
        else:
            file = f.f_code.co_filename.split("/mixprec/", 1)[1]
            counts[f"{file}:{f.f_code.co_qualname}"] += 1
    sys.setprofile(hook)
    step()
    sys.setprofile(None)
    counts["outside mixprec"] -= 1      # the setprofile(None) call
    return [(n, where) for where, n in counts.most_common(top)]


def op_table(step: Callable[[], None], device, rows: int = 20) -> str:
    """torch.profiler's table of five steps after five: each op's self CPU time (host work, launches
    included) and, on CUDA, its device time."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            step()
        _sync(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def interleaved_ratio(a: Callable[[], None], b: Callable[[], None], pairs: int, device,
                      warmup: int = 10) -> tuple[float, float, float, float]:
    """(median ratio a/b over per-pair times, median a seconds, median b seconds, fastest a / fastest b);
    pairs alternate order. On a loaded machine the fastest of each side is the least disturbed."""
    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0
    for _ in range(warmup):
        a(), b()
    ta, tb, ratios = [], [], []
    for i in range(pairs):
        if i % 2:
            y, x = timed(b), timed(a)
        else:
            x, y = timed(a), timed(b)
        ta.append(x), tb.append(y), ratios.append(x / y)
    return statistics.median(ratios), statistics.median(ta), statistics.median(tb), min(ta) / min(tb)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clip_word(clip: float | None) -> str:
    return "none" if clip is None else f"{clip:g}"


def cuda_captured(args, device) -> None:
    """The tiny model on CUDA, eager and captured, mixprec against torch.amp (eager and compiled).

    The variants of a row run round-robin (one step each per round, synchronised around each), so a
    drift in clocks or load hits all alike; the ratio is each variant's median over torch.amp eager's."""
    print(f"\n{'recipe':<10}{'clip':>6}{'variant':>24}{'us/step':>10}{'/ amp eager':>13}")
    for recipe in args.recipes.split(","):
        dtype = baseline_dtype(recipe)
        for clip in args.clip_values:
            torch._dynamo.reset()     # each row compiles afresh (Dynamo's recompile limit is per function)
            variants = {"torch.amp eager": amp_step(dtype, clip, device),
                        "torch.amp compiled": amp_step(dtype, clip, device, compiled=True, mark=True),
                        "mixprec eager": mixprec_step(recipe, clip, device)}
            if mixprec.get_recipe(recipe).fp8 is not None:      # fp8's compiled casts against eager ones
                variants["eager, casts fused"] = mixprec_step(recipe, clip, device, fused_casts=True)
            # The 2026-11-27 H100 and 11-28 H200 runs failed with gradients kept between steps
            # (zero_grad(set_to_none=False)): with the model in CUDA graphs they are outputs of its
            # backward graph, which the next replay overwrites. Set to None here, each step marked.
            ro = "reduce-overhead"
            captured = {"mixprec captured": dict(model_mode=ro, step_mode=ro),
                        "model ro, step default": dict(model_mode=ro, step_mode="default"),
                        "model default, step ro": dict(model_mode="default", step_mode=ro,
                                                       grads_to_none=False)}
            for name, how in captured.items():
                try:
                    variants[name] = mixprec_step(recipe, clip, device, mark=True,
                                                  **{"grads_to_none": True, **how})
                except ValueError as e:       # a recipe that cannot compile its step says why
                    print(f"{recipe:<10}{clip_word(clip):>6}  {name}: not run: {e}")
            times: dict[str, list[float]] = {name: [] for name in variants}
            for name, fn in list(variants.items()):
                try:
                    for _ in range(10):    # warm-up: compiling, CUDA-graph recording, optimizer state
                        fn()
                except Exception as e:     # report and go on with the other variants
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    print(f"{recipe:<10}{clip_word(clip):>6}{name:>24}  failed: {type(e).__name__}: "
                          f"{str(e)[:400]} (at {where.filename}:{where.lineno})")
                    del variants[name], times[name]
            for _ in range(args.pairs):
                for name, fn in variants.items():
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["torch.amp eager"])
            for name, ts in times.items():
                t = statistics.median(ts)
                print(f"{recipe:<10}{clip_word(clip):>6}{name:>24}{t * 1e6:>10.1f}{t / base:>13.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--clips", default="none,1.0", help="comma-separated: none or a max norm")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--no-time", action="store_true", help="counts only (deterministic)")
    ap.add_argument("--profile", action="store_true", help="also the top functions by calls per recipe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--guarded", action="store_true",
                    help="also each bf16-baseline recipe without clip against torch.amp bf16 that skips "
                         "inf/NaN steps as mixprec does (get_total_norm, step only where finite)")
    ap.add_argument("--torchao", action="store_true",
                    help="also fp8 (per-tensor current scaling) against torchao's fp8 training of the "
                         "same model, where torchao is installed")
    ap.add_argument("--trace", action="store_true",
                    help="also a torch.profiler table per recipe (no clip): host time by op, where the "
                         "step's time goes when it is not its Python calls")
    ap.add_argument("--captured", action="store_true",
                    help="the captured variants on a CPU too (compiled, no CUDA graphs): a dry run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.clip_values = [None if c == "none" else float(c) for c in args.clips.split(",")]
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
             else f", {torch.get_num_threads()} thread(s)")
          + f"; MLP 3 linears {WIDTH} wide, batch {BATCH}, fused AdamW")
    print("calls = Python function calls + C calls per whole step (sys.setprofile); ratio = median of "
          "interleaved per-pair times mixprec / torch.amp (< 1: mixprec faster); fastest = mixprec's "
          "fastest step / torch.amp's; us = median microseconds per step\n")
    print(f"{'recipe':<11}{'clip':>5}{'baseline':>18}{'calls':>7}{'(py)':>6}{'amp calls':>10}{'(py)':>6}"
          f"{'calls/amp':>10}{'ratio':>8}{'fastest':>9}{'us mixprec':>12}{'us amp':>9}")
    for recipe in args.recipes.split(","):
        dtype = baseline_dtype(recipe)
        for clip in args.clip_values:
            ours = mixprec_step(recipe, clip, device)
            c_ours = count_calls(ours)

            def row(baseline: str, theirs: Callable[[], None]) -> None:
                """One line: mixprec's step against ``theirs`` (calls, then interleaved times)."""
                c_theirs = count_calls(theirs)
                line = (f"{recipe:<11}{clip_word(clip):>5}{baseline:>18}{c_ours.total:>7}{c_ours.python:>6}"
                        f"{c_theirs.total:>10}{c_theirs.python:>6}{c_ours.total / c_theirs.total:>10.2f}")
                if not args.no_time:
                    r, ta, tb, fastest = interleaved_ratio(ours, theirs, args.pairs, device)
                    line += f"{r:>8.3f}{fastest:>9.3f}{ta * 1e6:>12.1f}{tb * 1e6:>9.1f}"
                print(line, flush=True)

            row("amp fp16+scaler" if dtype == torch.float16 else "amp bf16", amp_step(dtype, clip, device))
            if args.guarded and dtype == torch.bfloat16 and clip is None:
                # The same recipe against torch.amp bf16 with the same inf/NaN skip (a careful user's).
                row("amp bf16+skip", amp_step(dtype, clip, device, guarded=True))
            fp8 = mixprec.get_recipe(recipe).fp8
            if args.torchao and fp8 is not None and not fp8.blocked and not fp8.delayed:
                # Per-tensor current scaling against torchao's own fp8 training of the same model.
                ao = torchao_step(clip, device)
                if ao is None:
                    print(f"{recipe:<11}{clip_word(clip):>5}  torchao: not installed (pip install torchao)")
                else:
                    try:
                        row("torchao fp8", ao)
                    except RuntimeError as e:     # on CUDA torchao's fp8 GEMMs need dims of 16s
                        print(f"{recipe:<11}{clip_word(clip):>5}  torchao fp8 failed: "
                              f"{(str(e).splitlines() or [''])[0][:200]}")
    if args.profile:
        for recipe in args.recipes.split(","):
            print(f"\n{recipe}, no clip: calls per step by the innermost mixprec function making them")
            for n, fn in profile_calls(mixprec_step(recipe, None, device)):
                print(f"  {n:>4}  {fn}")
    if args.trace:
        for recipe in args.recipes.split(","):
            print(f"\n{recipe}, no clip: torch.profiler, 5 steps after 5, by self CPU time")
            print(op_table(mixprec_step(recipe, None, device), device))
    if device.type == "cuda" or args.captured:
        cuda_captured(args, device)


if __name__ == "__main__":
    main()
