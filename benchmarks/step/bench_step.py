"""MixedPrecision against the hand-written torch.amp loop, timed side by side in one run.

Two comparisons, each interleaved (A, B, A, B, ...) so drift in clock speed or load hits both alike:

1. a whole training step (forward, backward, optimizer) for a recipe: mixprec's engine against
   torch.autocast + torch.amp.GradScaler + the same fused AdamW;
2. the optimizer step alone (unscale + clip + AdamW) on the same gradients: mixprec's one norm pass
   plus fused AdamW with grad_scale/found_inf, against torch's unscale_ -> clip_grad_norm_ -> fused
   AdamW (scaler.step/update).

Prints medians and the ratio torch.amp / mixprec (> 1 means mixprec is faster). The ", compiled" rows
time ``torch.compile(model)`` + ``mp.compile_step()`` (CUDA graphs on CUDA) in the same interleaving.
Usage: python benchmarks/step/bench_step.py [--device cpu|cuda] [--reps 30] [--recipes fp16,bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def mlp(width: int, depth: int, device) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(device)


def interleave(fns: dict, reps: int, device) -> dict[str, float]:
    times = {k: [] for k in fns}
    for _ in range(3):                       # warm-up: allocator, kernels, lazy optimizer state
        for fn in fns.values():
            fn()
    for _ in range(reps):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def whole_step(recipe: str, device, width, depth, batch, reps, compiled=False, backend="inductor"):
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    low = mixprec.get_recipe(recipe).compute.dtype

    m1 = mlp(width, depth, device)
    mp = mixprec.MixedPrecision(m1, torch.optim.AdamW(m1.parameters(), lr=1e-4, fused=True), recipe)

    def ours():
        with mp.autocast():
            loss = F.cross_entropy(m1(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()

    m2 = mlp(width, depth, device)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=low == torch.float16)

    def theirs():
        with torch.autocast(device.type, dtype=low):
            loss = F.cross_entropy(m2(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt2)
        scaler.update()
        opt2.zero_grad(set_to_none=True)

    fns = {"mixprec": ours, "torch.amp": theirs}
    if compiled:
        try:
            fns.update(_compiled_steps(recipe, device, width, depth, x, y, low, backend))
        except Exception as e:     # the eager rows still count; the table says why these are missing
            fns["compiled error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}"
    error = fns.pop("compiled error", None)
    times = interleave(fns, reps, device)
    return (times | {"compiled error": error}) if error else times


def _compiled_steps(recipe, device, width, depth, x, y, low, backend) -> dict:
    """mixprec's compiled model and step, and torch.amp's compiled model, each compiled by three calls."""
    # The compiled variant: torch.compile(model) and mp.compile_step(); on CUDA as CUDA graphs. The
    # gradients are set to None each step: kept, they are outputs of the model's CUDA graph that its
    # next replay overwrites (the H100 and H200 runs of 2026-11-27/28). Each step marked as torch asks.
    m3 = mlp(width, depth, device)
    mp3 = mixprec.MixedPrecision(m3, torch.optim.AdamW(m3.parameters(), lr=1e-4, fused=True), recipe)
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    mp3.compile_step(mode=mode, backend=backend)
    f3 = torch.compile(m3, mode=mode, backend=backend)

    mark = torch.compiler.cudagraph_mark_step_begin if mode else (lambda: None)

    def ours_compiled():
        mark()
        with mp3.autocast():
            loss = F.cross_entropy(f3(x), y)
        mp3.backward(loss)
        mp3.step()
        mp3.zero_grad(set_to_none=True)
    # torch.amp's best on the same step: the compiled model (CUDA graphs on CUDA) and the eager
    # fused optimizer and GradScaler, as a user who compiles the model writes it.
    m4 = mlp(width, depth, device)
    opt4 = torch.optim.AdamW(m4.parameters(), lr=1e-4, fused=True)
    scaler4 = torch.amp.GradScaler(device.type, enabled=low == torch.float16)
    f4 = torch.compile(m4, mode=mode, backend=backend)

    def theirs_compiled():
        mark()
        with torch.autocast(device.type, dtype=low):
            loss = F.cross_entropy(f4(x), y)
        scaler4.scale(loss).backward()
        scaler4.step(opt4)
        scaler4.update()
        opt4.zero_grad(set_to_none=True)
    for _ in range(3):                   # compile outside the timed warm-up
        ours_compiled()
        theirs_compiled()
    return {"mixprec compiled": ours_compiled, "torch.amp compiled": theirs_compiled}


def optimizer_step(device, width, depth, reps, clip=1.0):
    m1, m2 = mlp(width, depth, device), mlp(width, depth, device)
    grads = [torch.randn_like(p) * 2.0**16 for p in m1.parameters()]   # as if scaled by S = 2**16

    mp = mixprec.MixedPrecision(m1, torch.optim.AdamW(m1.parameters(), lr=1e-6, fused=True), "fp16",
                                clip_grad_norm=clip)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-6, fused=True)
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))   # creates the scale tensor, as scaler.scale(loss) would

    def load(model):
        for p, g in zip(model.parameters(), grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        # Gradients written here stand for mp.backward's (already scaled by 2**16): tell the usage
        # checks so, or step() refuses them as unscaled.
        mp._checks.via_engine = True

    def ours():
        mp.step()

    def theirs():
        scaler.unscale_(opt2)
        torch.nn.utils.clip_grad_norm_(m2.parameters(), clip, foreach=True)
        scaler.step(opt2)
        scaler.update()

    # Gradients are restored before each timed call (outside the timing): unscale_ divides in place.
    times = {"mixprec": [], "torch.amp": []}
    for _ in range(3):
        load(m1), ours(), load(m2), theirs()
    for _ in range(reps):
        for name, fn in (("mixprec", ours), ("torch.amp", theirs)):
            load(m1 if name == "mixprec" else m2)
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in m1.parameters())
    return {k: statistics.median(v) for k, v in times.items()}, n_params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--recipes", default="fp16,bf16")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled-step rows")
    ap.add_argument("--opt-widths", default="512,2048",
                    help="MLP widths for the optimizer-step comparison (0.8M and 12.6M parameters; '' for none)")
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend of the compiled rows (aot_eager: a quick check of the code path)")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table as markdown to PATH (after each row)")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f", {torch.get_num_threads()} threads"))
    print(f"MLP {args.depth}x{args.width}, batch {args.batch}, {args.reps} interleaved reps, medians\n")
    title = (f"torch {torch.__version__}, {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
             + f"; MLP {args.depth}x{args.width}, batch {args.batch}, fused AdamW, {args.reps} interleaved reps, "
               f"medians; compile backend {args.backend}")
    print(f"{'comparison':<40}{'mixprec ms':>12}{'torch.amp ms':>14}{'torch/mixprec':>15}")
    rows = []

    def row(label: str, ours: float, theirs: float, baseline: str = "torch.amp eager") -> None:
        print(f"{label:<40}{ours * 1e3:>12.3f}{theirs * 1e3:>14.3f}{theirs / ours:>14.3f}x", flush=True)
        rows.append([label, baseline, f"{ours * 1e3:.3f}", f"{theirs * 1e3:.3f}", f"{theirs / ours:.3f}"])
        if args.markdown:
            lines = [title, "", "| comparison | torch.amp side | mixprec ms | torch.amp ms | torch.amp / mixprec |",
                     "|---|---|---|---|---|"] + ["| " + " | ".join(r) + " |" for r in rows]
            Path(args.markdown).write_text("\n".join(lines) + "\n")

    for recipe in args.recipes.split(","):
        t = whole_step(recipe, device, args.width, args.depth, args.batch, args.reps, not args.no_compile,
                       args.backend)
        row(f"whole step, {recipe}", t["mixprec"], t["torch.amp"])
        if "compiled error" in t:
            print(f"whole step, {recipe}, compiled: failed: {t['compiled error']}", flush=True)
            rows.append([f"whole step, {recipe}, compiled", "-", "failed", "-", t["compiled error"]])
        if "mixprec compiled" in t:
            row(f"whole step, {recipe}, compiled", t["mixprec compiled"], t["torch.amp"])
            row(f"whole step, {recipe}, compiled", t["mixprec compiled"], t["torch.amp compiled"],
                "torch.amp compiled model")
    for width in [int(w) for w in args.opt_widths.split(",") if w]:
        t, n = optimizer_step(device, width, args.depth, args.reps)
        row(f"optimizer step, {n / 1e6:.1f}M params", t["mixprec"], t["torch.amp"])
    print("\noptimizer step = unscale + clip to norm 1 + fused AdamW on gradients scaled by 2**16")
    print("compiled = torch.compile(model) + mp.compile_step() (CUDA: mode='reduce-overhead'), against the "
          "torch.amp eager loop (goal >= 2x) and against torch.amp with the model compiled the same way")


if __name__ == "__main__":
    main()
