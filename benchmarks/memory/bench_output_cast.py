"""Peak memory of the model-output cast: mixprec bf16 against plain torch.autocast and against casting
every output to fp32 (what mixprec did before 2026-11-22).

A Hugging Face-style language model (embedding, one linear block, a 32k-vocabulary head) computes its
own loss (``logits.float()`` inside, as HF does) and returns ``{"loss", "logits"}``; the loop keeps
that output alive through backward, as HF training loops do. Casting the returned logits to fp32 then
holds a 4-byte copy of them (2 bytes more per logit than autocast's bf16) until the step ends.

Each variant runs in its own process (peak RSS only grows), one training step after a warm-up step:

    python benchmarks/memory/bench_output_cast.py                 # CPU: peak RSS
    python benchmarks/memory/bench_output_cast.py --device cuda   # GPU: torch.cuda.max_memory_allocated
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, TOKENS = 32768, 256, 1024


class HFStyleLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(F.gelu(self.fc(self.emb(idx))))              # (B, T, V) in bf16
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _one(variant: str, device: str) -> float:
    import mixprec
    from mixprec.casting.model import cast_floating
    torch.manual_seed(0)
    model = HFStyleLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, VOCAB, (1, TOKENS), device=device)
    if variant == "autocast":
        ctx = lambda: torch.autocast(device, dtype=torch.bfloat16)   # noqa: E731
        backward, step = (lambda loss: loss.backward()), opt.step
    else:
        mp = mixprec.MixedPrecision(model, opt, "bf16")
        if variant == "cast every output":      # the old hook, installed on top of the new one
            model.register_forward_hook(lambda m, a, out: cast_floating(out, torch.float32))
        ctx, backward, step = mp.autocast, mp.backward, mp.step
    for i in range(2):
        if device == "cuda" and i == 1:
            torch.cuda.reset_peak_memory_stats()
        with ctx():
            out = model(idx, idx)
        backward(out["loss"])                   # `out` (and its logits) stays alive through backward
        step()
        opt.zero_grad(set_to_none=True)
        del out
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux -> MiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(f"{_one(args.variant, args.device):.1f}")
        return 0
    what = "peak RSS" if args.device == "cpu" else "peak allocated"
    print(f"torch {torch.__version__}, {args.device}; vocabulary {VOCAB}, {TOKENS} tokens, output kept "
          f"through backward; {what} in MiB, one process per variant")
    base = None
    for variant in ("autocast", "mixprec bf16", "cast every output"):
        out = subprocess.run([sys.executable, __file__, "--device", args.device, "--variant", variant],
                             capture_output=True, text=True, check=True)
        mib = float(out.stdout.strip().splitlines()[-1])
        base = base if base is not None else mib
        print(f"  {variant:<20}{mib:>10.1f}{mib - base:>+10.1f}")
    print(f"  (fp32 copy of the logits would be {TOKENS * VOCAB * 4 / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
