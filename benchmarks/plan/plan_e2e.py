"""The plan on bench_e2e's Llama, then its recipe timed against torch.amp bf16 and mixprec's bf16 and
per-tensor fp8, compiled: how far the speed model's predicted step ratio is from the measured one
(issue 34's GPU item).

1. ``mixprec plan`` (``run_plan``) on bench_e2e's Llama for ``--target``, trained here on ``--device``:
   fp32's band, bf16's lockstep and what-if, the gradient SNR, the verification, ``--plan-steps`` steps
   each, on a learnable synthetic token stream (each next token a fixed function of the last, with 10%
   noise: fp32 learns it within a few steps, so the band is a real one).
2. The plan's recipe, ``bf16``, ``fp8`` and the hand-written torch.amp bf16 loop, compiled, timed by
   ``bench_e2e.run_variant`` (same model, batches, fused AdamW, clip 1.0).
3. The predicted ratio (plan / bf16 on the target's roofline) beside the measured one, and the error.

    python benchmarks/plan/plan_e2e.py --device cuda --target h100 --layers 4  # 340M: about 4 minutes on an H100
    python benchmarks/plan/plan_e2e.py --cpu-smoke                               # a tiny Llama: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))   # bench_e2e
from bench_e2e import Llama, LlamaConfig, run_variant  # noqa: E402

from mixprec.lab.plan import plan_setup, run_plan  # noqa: E402
from mixprec.lab.workload import Split, Workload  # noqa: E402


def token_stream(vocab: int, t: int, rows: int, seed: int = 0) -> Split:
    """``rows`` windows of ``t + 1`` tokens where token i+1 = (5 * token i + 3) mod vocab, 10% random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(rows, t + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for i in range(t):
        x[:, i + 1] = (5 * x[:, i] + 3) % vocab
    noise = torch.rand(rows, t + 1, generator=g) < 0.1
    x = torch.where(noise, torch.randint(0, vocab, x.shape, generator=g), x)
    cut = rows * 7 // 8
    return Split(x[:cut, :-1], x[:cut, 1:], x[cut:, :-1], x[cut:, 1:])


def llama_workload(cfg: LlamaConfig, batch: int, t: int, fused: bool) -> Workload:
    """bench_e2e's Llama as a lab workload: fused AdamW at lr 1e-3 (bench_e2e times at 3e-4; a plan of a
    dozen steps needs fp32 to learn within them)."""
    data = token_stream(cfg.vocab, t, rows=batch * 16)
    return Workload(
        name=f"llama-{cfg.layers}L", summary="bench_e2e's Llama on a synthetic token stream",
        build_model=lambda: Llama(cfg, t), load_data=lambda: data,
        loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, fused=fused),
        metric=lambda out, y: float("nan"), metric_name="loss", batch_size=batch, default_steps=12,
        higher_is_better=False, tokens_per_sample=t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="h100", help="the GPU the plan predicts for (h100, h200, b200)")
    ap.add_argument("--layers", type=int, default=4, help="decoder blocks (4: 340M parameters; 10: 648M)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--plan-steps", type=int, default=12, help="lockstep steps per plan run (default 12)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny Llama on the CPU: checks the script")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, cfg, batch, t = torch.device("cpu"), LlamaConfig(256, 64, 2, 4, 128), 2, 32
        args.plan_steps, args.steps, args.warmup, args.backend = 8, 2, 1, "aot_eager"
        torch.set_num_threads(1)
    else:
        device, batch, t = torch.device(args.device), args.batch, args.seq
        cfg = dataclasses.replace(LlamaConfig(), layers=args.layers)
        if device.type != "cuda" or not torch.cuda.is_available():
            print("plan_e2e: error: this measures GPU steps; run it with --device cuda on a GPU, or pass "
                  "--cpu-smoke for a tiny CPU run that checks the script", file=sys.stderr)
            return 2
    start = time.perf_counter()
    workload = llama_workload(cfg, batch, t, fused=device.type == "cuda")
    report = run_plan(plan_setup(workload, target=args.target, steps=args.plan_steps, device=device),
                      lambda msg: print(f"plan: {msg}", file=sys.stderr, flush=True))
    planned = time.perf_counter() - start
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {gpu}; Llama {cfg.layers} layers, batch {batch} x {t}; plan for "
          f"{args.target} over {args.plan_steps} steps in {planned:.0f} s: "
          f"{'accepted' if report.accepted else 'NOT accepted'}")
    formats = {}
    for lay in report.layers:
        formats[lay.format] = formats.get(lay.format, 0) + 1
    print("formats: " + ", ".join(f"{k} x{v}" for k, v in formats.items()))
    print(f"recipe: {report.recipe or '(none)'}")
    print(f"predicted on {args.target}: plan / bf16 step = {report.step_ratio:.3f}")
    recipe = report.recipe or "bf16"
    rows = {}
    for name in dict.fromkeys(["amp-bf16", "bf16", "fp8", recipe]):
        r = run_variant(name, "compiled", cfg, batch, t, args.steps, args.warmup, device, args.backend)
        rows[name] = r
        label = "plan" if name == recipe and name not in ("bf16", "fp8") else name
        print(f"  {label:<10} compiled {r['ms']:9.2f} ms/step  peak {r['peak_gib']:.2f} GiB  loss {r['loss']:.4f}",
              flush=True)
    measured = rows[recipe]["ms"] / rows["bf16"]["ms"]
    print(f"measured here: plan / bf16 = {measured:.3f}; plan / torch.amp bf16 = "
          f"{rows[recipe]['ms'] / rows['amp-bf16']['ms']:.3f}; fp8 / bf16 = {rows['fp8']['ms'] / rows['bf16']['ms']:.3f}")
    print(f"speed model error (predicted / measured - 1): {report.step_ratio / measured - 1:+.1%}"
          + ("" if device.type == "cuda" else " (a CPU: not the target; the smoke checks the script only)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
