"""End to end: a Llama-style decoder trained under each mixprec recipe, eager and compiled, against the
hand-written torch.amp loop (eager and compiled) and torchao's float8 training where installed.

The model is our own (``Llama`` below): token embedding, pre-norm blocks of RMSNorm -> causal
self-attention with rotary position embeddings (``F.scaled_dot_product_attention``) -> RMSNorm ->
SwiGLU MLP, a final RMSNorm and an untied head; ``nn.Linear`` everywhere, so every matmul is an fp8
candidate. Default on a GPU: d=2048, 10 layers, SwiGLU width 5632, vocabulary 32768 (648M
parameters), batch 4 x 2048 tokens. ``--cpu-smoke``: d=64, 2 layers, batch 2 x 32 (checks the script).

Every variant trains the same model from the same initial weights on the same batches with fused
AdamW (lr 3e-4) and gradient clipping at 1.0:

- ``torch.amp bf16``: ``torch.autocast`` + ``clip_grad_norm_`` + ``opt.step()``, the loop users write;
- ``mixprec <recipe>``: ``MixedPrecision(model, opt, recipe, clip_grad_norm=1.0)``;
- ``torchao float8``: ``convert_to_float8_training`` (tensorwise; ``torchao-fp8-rowwise``: its rowwise
  recipe) under torch.amp bf16;
- ``compiled``: ``torch.compile(model)``, and for mixprec also ``mp.compile_step()``.

Variants run one after another (each holds a whole model and its optimizer: they do not fit side by
side on one GPU), each with its own warm-up, so compare ratios within one run only. Printed per
variant: ms/step (median), tokens/s, model TFLOP/s (6 N per token plus attention's 12 L d T) and MFU
against the GPU's dense bf16 peak, peak memory, and the loss after the timed steps; then the ratios the
issue sets goals for.

    python benchmarks/step/bench_e2e.py --device cuda                                   # everything (long)
    python benchmarks/step/bench_e2e.py --device cuda --variants amp-bf16,bf16,fp8 --modes compiled
    python benchmarks/step/bench_e2e.py --cpu-smoke --variants amp-bf16,bf16,fp8
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

# Dense bf16 tensor-core peaks (TFLOP/s) for MFU; an unknown GPU prints MFU as '-'.
_PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32768
    d: int = 2048
    layers: int = 10
    heads: int = 16
    ffn: int = 5632


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, T, d)
        # The mean square in fp32 whatever x is: a sum over d values.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)                                 # (B, H, T, hd/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, bias=False)
        self.proj = nn.Linear(cfg.d, cfg.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin).to(v.dtype), _rotate(k, cos, sin).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.d, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.d), SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-style decoder: tokens (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: LlamaConfig, max_t: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        hd = cfg.d // cfg.heads
        inv_freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(max_t, dtype=torch.float32), inv_freq)   # (T, hd/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def flops_per_token(model: Llama, t: int) -> float:
    """6 N (forward + backward of every weight; the embedding is a lookup) + 12 L d T (attention)."""
    cfg = model.cfg
    n = sum(p.numel() for p in model.parameters()) - model.emb.weight.numel()
    return 6 * n + 12 * cfg.layers * cfg.d * t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_loop(name: str, mode: str, model: Llama, device: torch.device, backend: str = "inductor"):
    """A ``step(idx, tgt) -> loss`` for one variant."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    compiled = mode == "compiled"
    if name in ("amp-bf16", "torchao-fp8", "torchao-fp8-rowwise"):
        if name.startswith("torchao-fp8"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training   # optional
            config = Float8LinearConfig.from_recipe_name("rowwise") if name.endswith("rowwise") else None
            convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
        fwd = torch.compile(model, backend=backend) if compiled else model

        def step(idx, tgt):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(fwd(idx).flatten(0, 1), tgt.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the emulation notice on GPUs without fp8
        mp = mixprec.MixedPrecision(model, opt, name, clip_grad_norm=1.0,
                                    # A named fp8 recipe keeps the head bf16 (as torchao's rows do); a
                                    # full recipe string (a plan's) says itself where fp8 goes.
                                    fp8_filter=(lambda n, m: n != "head") if "fp8" in name and "=" not in name
                                    else None)
    if compiled:
        mp.compile_step(backend=backend)
    fwd = torch.compile(model, backend=backend) if compiled else model

    def step(idx, tgt):
        with mp.autocast():
            loss = F.cross_entropy(fwd(idx).flatten(0, 1), tgt.flatten())
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        return loss
    return step


def run_variant(name: str, mode: str, cfg: LlamaConfig, batch: int, t: int, steps: int, warmup: int,
                device: torch.device, backend: str = "inductor") -> dict:
    torch.manual_seed(0)
    model = Llama(cfg, t).to(device)
    fpt = flops_per_token(model, t)
    step = _make_loop(name, mode, model, device, backend)
    g = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (batch, t + 1), device=device, generator=g) for _ in range(4)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for i in range(warmup + steps):
        data = batches[i % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        loss = step(data[:, :-1], data[:, 1:])
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    tokens = batch * t
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    out = dict(variant=f"{name} {mode}", ms=ms, tok_s=tokens / ms * 1e3,
               tflops=fpt * tokens / ms / 1e9, peak_gib=peak, loss=float(loss.detach()))
    del model, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="amp-bf16,torchao-fp8,fp32,tf32,fp16,bf16,fp16-pure,bf16-pure,"
                                          "bf16-sr,fp8,fp8-delayed",
                    help="comma-separated: amp-bf16, torchao-fp8 or mixprec recipe names")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=LlamaConfig.layers,
                    help=f"decoder blocks (default {LlamaConfig.layers}: 648M parameters; 4 gives 340M)")
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend of the compiled rows (aot_eager: a quick check of the code path)")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table as markdown to PATH (after each row)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU: checks the script")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, cfg, batch, t = torch.device("cpu"), LlamaConfig(256, 64, 2, 4, 128), 2, 32
        torch.set_num_threads(1)      # tiny kernels: threads only contend on a shared CPU
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    else:
        device, batch, t = torch.device(args.device), args.batch, args.seq
        cfg = dataclasses.replace(LlamaConfig(), layers=args.layers)
        if device.type != "cuda" or not torch.cuda.is_available():
            print("bench_e2e: error: this benchmark measures GPU training; run it with --device cuda on a "
                  "GPU, or pass --cpu-smoke for a tiny CPU run that checks the script", file=sys.stderr)
            return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in _PEAK_BF16.items() if k in gpu), None)
    n_params = sum(p.numel() for p in Llama(cfg, 8).parameters())
    title = (f"torch {torch.__version__}, {gpu}; Llama-style {n_params / 1e6:.0f}M parameters "
             f"({cfg.layers} layers), batch {batch} x {t} tokens, fused AdamW, clip 1.0; median of {args.steps} "
             f"steps after {args.warmup}; compile backend {args.backend}")
    print(title + "\n")
    print(f"{'variant':<26}{'ms/step':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}{'loss':>9}")
    rows, cells = {}, []
    for mode in args.modes.split(","):
        for name in args.variants.split(","):
            try:
                r = run_variant(name, mode, cfg, batch, t, args.steps, args.warmup, device, args.backend)
            except Exception as exc:    # a variant this machine cannot run (tf32 on a CPU, no torchao)
                why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:90]}"
                print(f"{name + ' ' + mode:<26}  skipped: {why}", flush=True)
                cells.append([f"{name} {mode}", f"skipped: {why}", "", "", "", "", ""])
            else:
                rows[r["variant"]] = r
                mfu = f"{r['tflops'] / peak:.0%}" if peak else "-"
                print(f"{r['variant']:<26}{r['ms']:>10.2f}{r['tok_s']:>12.0f}{r['tflops']:>9.1f}{mfu:>7}"
                      f"{r['peak_gib']:>10.2f}{r['loss']:>9.4f}", flush=True)
                cells.append([r["variant"], f"{r['ms']:.2f}", f"{r['tok_s']:.0f}", f"{r['tflops']:.1f}", mfu,
                              f"{r['peak_gib']:.2f}", f"{r['loss']:.4f}"])
            if args.markdown:          # after every row: a run stopped by a time limit keeps its rows
                _write_markdown(args.markdown, title, cells, rows)
    print("\ngoal ratios (> 1: the first is faster)")
    for line in _ratios(rows):
        print("  " + line)
    return 0


_GOALS = (("bf16 compiled", "amp-bf16 compiled", 1.0), ("fp8 compiled", "amp-bf16 compiled", 1.25),
          ("fp8 compiled", "torchao-fp8 compiled", 1.0), ("fp8-rowwise compiled", "amp-bf16 compiled", 1.0),
          ("fp8-rowwise compiled", "torchao-fp8-rowwise compiled", 1.0), ("fp8 eager", "bf16 eager", 1.0),
          ("bf16 eager", "amp-bf16 eager", 1.0))


def _ratios(rows: dict) -> list[str]:
    """The speed ratios the issues set goals for, among the rows measured."""
    return [f"mixprec {a} vs {b}: {rows[b]['ms'] / rows[a]['ms']:.2f}x (goal >= {goal:.2f}x)"
            for a, b, goal in _GOALS if a in rows and b in rows]


def _write_markdown(path: str, title: str, cells: list[list[str]], rows: dict) -> None:
    lines = [title, "", "| variant | ms/step | tokens/s | TFLOP/s | MFU | peak GiB | loss |", "|---" * 7 + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    lines += ["", "Ratios (> 1: the first is faster): " + ("; ".join(_ratios(rows)) or "none measured yet")]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
