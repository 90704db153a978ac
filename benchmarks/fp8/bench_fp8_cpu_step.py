"""The fp8 goal on a CPU: one eager training step of the lab's gpt under fp8 against bf16.

Each recipe gets its own model, optimizer and engine; the steps run interleaved (bf16, fp8, fp8
emulated, bf16, ...) so drift in clock speed or load hits them alike, and medians are compared. The
``fp8`` row is ``backend=auto``: the backend the measured probe picked on this CPU (printed). Goal
(issue 27): fp8 no slower than 3x bf16.

    python benchmarks/fp8/bench_fp8_cpu_step.py [--reps 20] [--threads 1] [--recipes "bf16;fp8-rowwise;nvfp4"]

``--recipes``: other recipes to time instead (';'-separated; bf16 is always timed, the yardstick), e.g.
the blocked formats of issue 25. ``--model mixtral``: a small Hugging Face Mixtral instead (hidden 128,
8 experts of 256, top 2, 2 layers, batch 8 x 64 random tokens; needs transformers), whose experts run
fp8 grouped GEMMs under ``fp8``; ``fp8 (experts bf16)`` keeps them out (``skip=*.experts.*``)::

    python benchmarks/fp8/bench_fp8_cpu_step.py --model mixtral --recipes "fp8;compute=bf16,fp8=current(skip=*.experts.*)"
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


def _gpt():
    """The lab's gpt: (model, optimizer, loss of (model, x, y), x, y)."""
    data = GPT_CHAR.load_data()
    x, y = data.x_train[:GPT_CHAR.batch_size], data.y_train[:GPT_CHAR.batch_size]   # (32, 64) each
    model = GPT_CHAR.build_model()
    return model, GPT_CHAR.make_optimizer(model.parameters()), lambda m, a, b: GPT_CHAR.loss_fn(m(a), b), x, y


def _mixtral():
    """A small HF Mixtral on random tokens: (model, optimizer, loss, x, y)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                        num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), \
        lambda m, a, b: m(input_ids=a, labels=b).loss, ids, ids


MODELS = {"gpt": _gpt, "mixtral": _mixtral}


def step_fn(recipe: str, build):
    torch.manual_seed(0)
    model, optimizer, loss_of, x, y = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the emulation notice: asked for here
        mp = mixprec.MixedPrecision(model, optimizer, recipe)

    def step() -> None:
        with mp.autocast():
            loss = loss_of(model, x, y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return step, mp


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--recipes", default=None, help="';'-separated recipes to time (default: the fp8 backends)")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt")
    args = p.parse_args(argv)
    recipes = RECIPES if args.recipes is None else {"bf16": "bf16"} | {
        r.strip(): r.strip() for r in args.recipes.split(";") if r.strip()}
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, engines = {}, {}
    for name, recipe in recipes.items():
        steps[name], engines[name] = step_fn(recipe, MODELS[args.model])
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
    what = f"lab gpt, batch {GPT_CHAR.batch_size} x 64" if args.model == "gpt" else \
        "HF Mixtral (hidden 128, 8 experts of 256, top 2, 2 layers), batch 8 x 64"
    print(f"{what}, {args.reps} interleaved eager steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), medians")
    for name, t in medians.items():
        backend = engines[name].fp8_report.backend if engines[name].fp8_report else ""
        swapped = f"{len(engines[name].fp8_report.swapped)} fp8 layers" if engines[name].fp8_report else ""
        print(f"  {name:16s} {t * 1e3:8.2f} ms  {t / medians['bf16']:5.2f}x bf16  {backend} {swapped}")
    return medians


if __name__ == "__main__":
    main()
