"""What issue 15's misuse checks cost per training step, measured side by side in one run.

The engine's checks (usage_checks.UsageChecks) run in every step(): a loop over the model's gradients
(weakref + version counter of each), two flags, and, on the fused path, one tiny device op for the
consecutive-skip counter. Here the same engine trains with the checks on and with them stubbed out
(no-ops), interleaved A, B, A, B so load drift hits both alike; medians and the ratio are printed.

Usage: python benchmarks/host/bench_usage_checks.py [--device cpu|cuda] [--reps 40] [--depth 8] [--width 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def build(width: int, depth: int, device: torch.device, recipe: str, checks: bool):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mp = mixprec.MixedPrecision(model, opt, recipe)
    if not checks:
        mp._checks.check_before_step = lambda grads: None
        mp._checks.after_step = lambda grads, found_inf, stepped: None
        mp._checks.on_backward = lambda: None
    return mp


def time_steps(mp, x, y, n: int, device: torch.device) -> float:
    """Median seconds of one whole step (forward, backward, step, zero_grad) over n steps."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with mp.autocast():
            loss = F.cross_entropy(mp.model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--recipes", default="bf16,fp16-pure")
    args = ap.parse_args()
    device = torch.device(args.device)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    print(f"device {device}, MLP {args.depth}x{args.width}, batch {args.batch}, {args.reps} reps x 5 steps, "
          "interleaved; median seconds per whole step")
    for n in (18, 150, 600):
        print(f"checks alone, {n:4d} parameter tensors: {checks_alone(n, device):7.1f} us per step")
    for recipe in args.recipes.split(","):
        on, off = build(args.width, args.depth, device, recipe, True), build(args.width, args.depth, device,
                                                                             recipe, False)
        for mp in (on, off):
            time_steps(mp, x, y, 5, device)              # warm-up: allocations, optimizer state
        t_on, t_off = [], []
        for _ in range(args.reps):
            t_on.append(time_steps(on, x, y, 5, device))
            t_off.append(time_steps(off, x, y, 5, device))
        m_on, m_off = statistics.median(t_on), statistics.median(t_off)
        print(f"{recipe:10s} checks on {m_on * 1e3:8.3f} ms   off {m_off * 1e3:8.3f} ms   "
              f"on/off {m_on / m_off:.3f}   (+{(m_on - m_off) * 1e6:.1f} us/step)")


def checks_alone(n_params: int, device: torch.device, reps: int = 2000) -> float:
    """Median microseconds of the checks' own work in one step, for a model with n_params tensors:
    the model-gradient list, check_before_step (fast path: mp.backward was called) and after_step."""
    from mixprec.recipe import get_recipe
    from mixprec.guards.usage import UsageChecks
    params = [nn.Parameter(torch.zeros(4, device=device)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.zeros(4, device=device)
    checks = UsageChecks(get_recipe("fp32"), False, device)   # fp32: no autocast warning to print
    found_inf = torch.zeros((), dtype=torch.bool, device=device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        checks.on_backward()
        grads = [p.grad for p in params if p.grad is not None]
        checks.check_before_step(grads)
        checks.after_step(grads, found_inf, None)     # None: the fused path (device counter)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    main()
