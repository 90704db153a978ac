"""Do the blocked fp8/fp4 recipes train a third-party model (HF Llama, tiny config) as fp32 does?

Two measurements, both on ``transformers.LlamaForCausalLM`` with the tiny config of
``tests/integrations/hf_tiny.py`` (hidden 64, MLP 128, 2 layers, 2 heads, 1 KV head, head_dim 32):

1. Seed band. ``llama_tiny`` below is a lab workload (``package.module:function``, docs/compare.md)
   that trains that Llama on the lab's gpt data (CPython's pydoc text, characters, context 64; so the
   vocabulary is the text's 103 characters, not hf_tiny's 64), batch 8, AdamW lr 3e-3, 100 steps. The
   model is built under each run's seed, so ``seed_noise.py`` varies init and batch order and prints
   fp32's band::

       PYTHONPATH=benchmarks/quality python benchmarks/quality/seed_noise.py \\
           --workloads frontier_formats_train:llama_tiny --seeds 0,1,2 --recipes "fp32;bf16;fp8;fp8-rowwise;fp8-block;mxfp8;nvfp4" [--steps N]

2. Fixed-seed yardstick (this script's ``__main__``). ``tests/integrations/matrix_run.train_curve``
   trains hf_tiny's Llama from seed 0 on one fixed batch; it cannot vary the seed, so each recipe's
   curve is compared with fp32's (``aligned_deviation``: worst gap after the same number of updates,
   relative to fp32's first loss) and bf16's own deviation is the yardstick::

       python benchmarks/quality/frontier_formats_train.py [--steps 40] [--lr 3e-3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from mixprec.lab.workloads import (
    Split,
    char_vocab,
    cross_entropy,
    mean_cross_entropy,
    pydoc_text,
    text_windows,
)

RECIPES = ("fp32", "bf16", "fp8", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4",
           "bf16,fp8=nvfp4(sr=false,rht=false)")
_BLOCK = 64          # context, as the lab's gpt
_VAL_WINDOWS = 128   # the first 128 of the held-out text's 726 windows: evaluation is a tenth of the cost


def llama_tiny() -> dict:
    """The lab workload: hf_tiny's Llama config on pydoc characters (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text = pydoc_text()
    vocab = char_vocab(text)
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
    n_train = int(len(ids) * 0.9)                       # the lab gpt's split
    x_train, y_train = text_windows(ids[:n_train], _BLOCK, 16)
    x_val, y_val = text_windows(ids[n_train:], _BLOCK, _BLOCK)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=_BLOCK)
    return {
        "model": lambda: LlamaForCausalLM(cfg),         # a function: built under each run's seed
        "data": Split(x_train, y_train, x_val[:_VAL_WINDOWS], y_val[:_VAL_WINDOWS]),
        "loss": cross_entropy, "metric": mean_cross_entropy, "metric_name": "loss",
        "higher_is_better": False,
        "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-3),
        "batch_size": 8, "steps": 100, "tokens_per_sample": _BLOCK,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--recipes", default=";".join(RECIPES), help="';'-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")      # the one-time "emulated on cpu" notices
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integrations"))
    import matrix_run
    import transformers  # noqa: F401  (imported here, so fp32's time below does not include it)

    recipes = args.recipes.split(";")
    if recipes[0] != "fp32":
        recipes.insert(0, "fp32")
    print(f"torch {torch.__version__}, cpu, {args.threads} thread(s); hf_tiny llama, seed 0, "
          f"one fixed batch, {args.steps} AdamW steps, lr {args.lr}")
    ref = None
    width = max(len(r) for r in recipes) + 2
    print(f"{'recipe':<{width}}{'first':>8}{'final':>9}{'deviation':>11}{'skipped':>9}{'s':>7}")
    for recipe in recipes:
        t0 = time.perf_counter()
        losses, skipped, _, _ = matrix_run.train_curve("llama", recipe, steps=args.steps, lr=args.lr)
        seconds = time.perf_counter() - t0
        ref = losses if ref is None else ref
        dev = matrix_run.aligned_deviation(losses, skipped, ref)
        print(f"{recipe:<{width}}{losses[0]:>8.4f}{losses[-1]:>9.4f}{dev:>11.4f}{sum(skipped):>9}"
              f"{seconds:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
