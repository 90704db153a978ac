"""Per-layer weight-gradient error of each recipe against fp32, at points of a training trajectory.

Trains ``lockstep``'s GPT under ``--trajectory`` (default mxfp8) and, at the given iterations, computes
every linear weight's gradient on ``--batches`` fixed batches under fp32 and under each recipe, from the
same weights. Per layer and recipe: the relative error ``|g_r - g| / |g|`` (mean over batches), the
relative bias ``|mean(g_r - g)| / |mean(g)|``, the sign agreement (share of entries whose sign matches
fp32's, weighted by ``|g|``) and the SNR ``|g| / |g_r - g|`` against the sqrt(3) threshold.

    python benchmarks/quality/grad_probe.py --at 0,200,400,600 --recipes "bf16;fp8;fp8-rowwise;mxfp8;nvfp4"
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mixprec  # noqa: E402
from lockstep import Shape, corpus, train_lockstep  # noqa: E402
from mixprec.lab.models import GPT, GPTConfig  # noqa: E402


def grads(state: dict, recipe: str, batches: list, device: str) -> list[dict[str, torch.Tensor]]:
    s = Shape()
    _, _, vocab = corpus()
    model = GPT(GPTConfig(vocab_size=vocab, block_size=s.block, n_layer=s.n_layer, n_head=s.n_head,
                          n_embd=s.n_embd)).to(device)
    model.load_state_dict(state)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
    out = []
    for x, y in batches:
        with mp.autocast():
            logits = model(x)
        mp.backward(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
        out.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                    if p.grad is not None and n.endswith("weight") and p.dim() == 2 and ".blocks." in "." + n})
        mp.zero_grad()
    return out


def measure(ref: list[dict], test: list[dict]) -> dict[str, dict[str, float]]:
    res = {}
    for name in ref[0]:
        g = torch.stack([r[name] for r in ref])                # (B, ...)
        q = torch.stack([t[name] for t in test])
        err = (q - g).flatten(1).norm(dim=1) / g.flatten(1).norm(dim=1)
        bias = (q - g).mean(0).norm() / g.mean(0).norm()
        w = g.abs()
        sign = ((torch.sign(q) == torch.sign(g)).float() * w).sum() / w.sum()
        res[name] = {"rel_err": err.mean().item(), "bias": bias.item(), "sign": sign.item(),
                     "snr": (1 / err).mean().item()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectory", default="mxfp8")
    ap.add_argument("--recipes", default="bf16;fp8;fp8-rowwise;mxfp8;nvfp4")
    ap.add_argument("--at", default="0,200,400,600", help="iterations (< --iters): the weights after that many updates")
    ap.add_argument("--iters", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    at = {int(a) for a in args.at.split(",")}
    states = {}

    def snap(it: int, model: torch.nn.Module) -> None:
        if it in at:
            states[it] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    train_lockstep(args.trajectory, seed=args.seed, iters=args.iters, eval_every=args.iters, device=args.device,
                   on_step=snap)
    train, _, _ = corpus()
    g = torch.Generator().manual_seed(999)
    batches = []
    for _ in range(args.batches):
        ix = torch.randint(len(train) - 65, (32,), generator=g)
        batches.append((torch.stack([train[i:i + 64] for i in ix.tolist()]).to(args.device),
                        torch.stack([train[i + 1:i + 65] for i in ix.tolist()]).to(args.device)))
    rows = []
    for it in sorted(states):
        ref = grads(states[it], "fp32", batches, args.device)
        for recipe in args.recipes.split(";"):
            m = measure(ref, grads(states[it], recipe, batches, args.device))
            for layer, v in m.items():
                rows.append({"it": it, "recipe": recipe, "layer": layer, **v})
            worst = min(v["snr"] for v in m.values())
            print(f"it {it:4d} {recipe:>12}: rel_err mean {sum(v['rel_err'] for v in m.values()) / len(m):.4f} "
                  f"bias mean {sum(v['bias'] for v in m.values()) / len(m):.4f} "
                  f"sign min {min(v['sign'] for v in m.values()):.4f} snr min {worst:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh)


if __name__ == "__main__":
    main()
