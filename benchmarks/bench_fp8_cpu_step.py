"""The fp8 goal on a CPU: one eager training step of the lab's gpt under fp8 against bf16.

Each recipe gets its own model, optimizer and engine; the steps run interleaved (bf16, fp8, fp8
emulated, bf16, ...) so drift in clock speed or load hits them alike, and medians are compared. The
``fp8`` row is ``backend=auto``: the backend the measured probe picked on this CPU (printed). Goal
(issue 27): fp8 no slower than 3x bf16.

    python benchmarks/bench_fp8_cpu_step.py [--reps 20] [--threads 1] [--recipes "bf16;fp8-rowwise;nvfp4"]

``--recipes``: other recipes to time instead (';'-separated; bf16 is always timed, the yardstick), e.g.
the blocked formats of issue 25.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import mixprec
from mixprec.lab.workloads import GPT_CHAR

RECIPES = {"bf16": "bf16", "fp8 (auto)": "fp8", "fp8 (emulate)": "fp8,fp8=current(backend=emulate)",
           "fp8 (scaled_mm)": "fp8,fp8=current(backend=scaled_mm)"}


def step_fn(recipe: str, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    model = GPT_CHAR.build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the emulation notice: asked for here
        mp = mixprec.MixedPrecision(model, GPT_CHAR.make_optimizer(model.parameters()), recipe)

    def step() -> None:
        with mp.autocast():
            loss = GPT_CHAR.loss_fn(model(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return step, mp


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--recipes", default=None, help="';'-separated recipes to time (default: the fp8 backends)")
    args = p.parse_args(argv)
    recipes = RECIPES if args.recipes is None else {"bf16": "bf16"} | {
        r.strip(): r.strip() for r in args.recipes.split(";") if r.strip()}
    if args.threads:
        torch.set_num_threads(args.threads)
    data = GPT_CHAR.load_data()
    x, y = data.x_train[:GPT_CHAR.batch_size], data.y_train[:GPT_CHAR.batch_size]   # (32, 64) each
    steps, engines = {}, {}
    for name, recipe in recipes.items():
        steps[name], engines[name] = step_fn(recipe, x, y)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(3):                                   # warm-up
        for fn in steps.values():
            fn()
    for _ in range(args.reps):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"lab gpt, batch {GPT_CHAR.batch_size} x 64, {args.reps} interleaved eager steps, "
          f"{torch.get_num_threads()} thread(s), medians")
    for name, t in medians.items():
        backend = engines[name].fp8_report.backend if engines[name].fp8_report else ""
        print(f"  {name:16s} {t * 1e3:8.2f} ms  {t / medians['bf16']:5.2f}x bf16  {backend}")
    return medians


if __name__ == "__main__":
    main()
