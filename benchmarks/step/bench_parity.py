"""MixedPrecision against the hand-written torch.amp loop it replaces: speed, aten ops, and weights.

For every model x mode x optimizer x recipe, both loops are built in one process from the same seed
(the same initial weights) and fed the same fixed list of batches:

- torch.amp: ``with torch.autocast(device, dtype): loss = ...``, then ``scaler.scale(loss).backward();
  scaler.step(opt); scaler.update()`` with a GradScaler for fp16 compute, ``loss.backward(); opt.step()``
  for bf16, then ``opt.zero_grad()``;
- mixprec: ``with mp.autocast(): loss = ...; mp.backward(loss); mp.step(); mp.zero_grad()``.

Each recipe's baseline is the torch.amp loop in its compute dtype: fp16 and fp16-pure against autocast
fp16 + GradScaler; bf16, bf16-pure and bf16-sr against autocast bf16. Models: ``mlp`` (3 x Linear 512 +
GELU, 10 classes, batch 128), ``lm`` (mixprec.lab.models.GPT, 4 layers, d=256, vocab 256, 64 tokens,
batch 8), ``lm-large`` (6 layers, d=512), ``lm-gpu`` (4 layers, d=1024, 512 tokens, batch 16: GPU-bound
on an H100, where ``lm`` is host-bound). Modes: ``eager``; ``compiled`` (``torch.compile(model)`` on
both sides); ``compile_step`` (mixprec: compiled model + ``mp.compile_step()``, against the compiled
torch.amp model with an eager fused AdamW; always fused AdamW).

After the warm-up (where compiling happens), pairs of steps run interleaved (A, B, then B, A, ...),
each timed whole: forward + backward + step + zero_grad. "ratio" is the median of the per-pair ratios
mixprec / torch.amp and "range" their min-max: below 1 means mixprec is faster. "ops" are the aten ops
one eager step dispatches (mixprec.diagnostics.op_count; '-' for compiled rows). "weights equal" says
whether, after all steps, mixprec's parameters equal torch.amp's bit for bit (n/a for the recipes
that hold 16-bit weights: bf16-pure, bf16-sr, fp16-pure are not meant to match); where they do not, a
second torch.amp loop over the same batches says whether torch.amp equals itself ("twin yes": a parity
break) or not ("twin NO": run-to-run nondeterministic kernels, where nothing can match bit for bit).

The table goes into benchmarks/HISTORY.md and its newest figures into RESULTS.md (``--markdown PATH``
writes it with the machine, date and command).

Usage: python benchmarks/step/bench_parity.py [--models mlp,lm,lm-large] [--recipes fp16,bf16,bf16-pure,bf16-sr]
       [--modes eager,compiled,compile_step] [--optimizers foreach,fused] [--pairs 15] [--warmup 3]
       [--threads 1] [--device cpu|cuda] [--quick] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.diagnostics.op_count import count_aten_ops
from mixprec.lab.models import GPT, GPTConfig

# name: (full size, --quick size); GPT sizes are (n_layer, n_head, n_embd, block_size, batch).
SIZES = {
    "mlp": ((512, 128), (64, 16)),                   # (width, batch)
    "lm": ((4, 4, 256, 64, 8), (1, 2, 32, 16, 2)),
    "lm-large": ((6, 8, 512, 64, 8), (2, 4, 64, 16, 2)),
    # GPU-bound on an H100 (about 50M weights, 8192 tokens a step): the host's launches hide behind
    # the kernels, so the ratio measures the device work; "lm" is the host-bound one there.
    "lm-gpu": ((4, 16, 1024, 512, 16), (1, 2, 32, 16, 2)),
}
VOCAB = 256
COLUMNS = [("model", 9), ("mode", 13), ("optimizer", 10), ("recipe", 12), ("baseline", 17),
           ("ratio median", 13), ("ratio range", 12), ("ms mixprec", 11), ("ms torch.amp", 13),
           ("ops mixprec", 12), ("ops torch.amp", 14), ("weights equal", 13)]


def make_model(name: str, quick: bool, device) -> nn.Module:
    torch.manual_seed(0)                               # both sides start from the same weights
    if name == "mlp":
        width, _ = SIZES[name][quick]
        layers = [m for _ in range(3) for m in (nn.Linear(width, width), nn.GELU())]
        return nn.Sequential(*layers, nn.Linear(width, 10)).to(device)
    n_layer, n_head, n_embd, block, _ = SIZES[name][quick]
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=block, n_layer=n_layer, n_head=n_head,
                         n_embd=n_embd)).to(device)


def make_batches(name: str, quick: bool, n: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)               # the same batches, in order, for both sides
    if name == "mlp":
        width, batch = SIZES[name][quick]
        make = lambda: (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
    else:
        *_, block, batch = SIZES[name][quick]
        make = lambda: (torch.randint(0, VOCAB, (batch, block), generator=g),
                        torch.randint(0, VOCAB, (batch, block), generator=g))
    return [tuple(t.to(device) for t in make()) for _ in range(n)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))   # (B, 10) or (B*T, V)


def adamw(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))


def mixprec_loop(model, recipe: str, fused: bool, mode: str, backend: str = "inductor"):
    with warnings.catch_warnings():                    # construction notices (e.g. emulation) are not news here
        warnings.simplefilter("ignore")
        mp = mixprec.MixedPrecision(model, adamw(model, fused), recipe)
    if mode == "compile_step":
        mp.compile_step(backend=backend)
    forward = model if mode == "eager" else torch.compile(model, backend=backend)

    def step(x, y):
        with mp.autocast():
            loss = loss_fn(forward(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return step


def amp_loop(model, dtype: torch.dtype, fused: bool, mode: str, device, backend: str = "inductor"):
    opt = adamw(model, fused)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    forward = model if mode == "eager" else torch.compile(model, backend=backend)

    def step(x, y):
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_fn(forward(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    return step


def timed(step, batch, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(*batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_row(model_name, mode, optimizer, recipe, args, device) -> list[str]:
    """One comparison; returns the row's cells after the first four (model, mode, optimizer, recipe)."""
    r = mixprec.get_recipe(recipe)
    dtype = r.compute.dtype
    baseline = "amp fp16+scaler" if dtype == torch.float16 else "amp bf16"
    if mode != "eager":
        torch._dynamo.reset()                          # each row compiles its own graphs
    fused = optimizer == "fused"
    ours_model, theirs_model = make_model(model_name, args.quick, device), make_model(model_name, args.quick, device)
    ours = mixprec_loop(ours_model, recipe, fused, mode, args.backend)
    amp_step, seen = amp_loop(theirs_model, dtype, fused, mode, device, args.backend), []

    def theirs(x, y):                                  # torch.amp's loop, recording the batches it saw
        seen.append((x, y))
        amp_step(x, y)

    warmup = args.warmup if mode == "eager" else max(args.warmup, 3)
    batches = iter(make_batches(model_name, args.quick, warmup + 1 + args.pairs, device))
    for _ in range(warmup):                            # compiling, lazy optimizer state, allocator
        batch = next(batches)
        ours(*batch)
        theirs(*batch)
    ops = ["-", "-"]
    if mode == "eager":
        batch = next(batches)
        ops = [str(count_aten_ops(lambda: step(*batch)).total) for step in (ours, theirs)]

    times = {ours: [], theirs: []}
    for i in range(args.pairs):
        batch = next(batches)
        for step in ((ours, theirs) if i % 2 == 0 else (theirs, ours)):
            times[step].append(timed(step, batch, device))
    ratios = [a / b for a, b in zip(times[ours], times[theirs])]

    same = lambda m1, m2: all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    if r.param.is_low:
        equal = "n/a"
    elif same(ours_model, theirs_model):
        equal = "yes"
    else:
        # Is torch.amp's loop itself reproducible here? A second one over the same batches tells a
        # parity break ("twin yes") from kernels that are not run to run deterministic ("twin NO":
        # e.g. atomics in an attention backward on a GPU), where no loop can match bit for bit.
        twin_model = make_model(model_name, args.quick, device)
        twin = amp_loop(twin_model, dtype, fused, mode, device, args.backend)
        for batch in seen:
            twin(*batch)
        equal = f"NO (torch.amp twin {'yes' if same(twin_model, theirs_model) else 'NO'})"
    return [baseline, f"{statistics.median(ratios):.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
            f"{statistics.median(times[ours]) * 1e3:.2f}", f"{statistics.median(times[theirs]) * 1e3:.2f}",
            *ops, equal]


def write_markdown(path: str, title: str, rows: list[list[str]]) -> None:
    lines = [title, "", "| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in rows]
    Path(path).write_text("\n".join(lines) + "\n")


def header(args, device) -> str:
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        names = [line.split(":", 1)[1].strip() for line in
                 (cpuinfo.read_text().splitlines() if cpuinfo.exists() else []) if line.startswith("model name")]
        machine = f"{names[0]}, {len(names)} cores" if names else "CPU model unknown"
    sizes = "quick (tiny) sizes" if args.quick else "full sizes"
    return (f"torch {torch.__version__}, {device} ({machine}), {args.threads} thread(s), "
            f"{datetime.date.today().isoformat()}, {sizes}, {args.pairs} pairs, {args.warmup} warm-up steps; "
            f"`python {' '.join(sys.argv)}`")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,lm,lm-large")
    ap.add_argument("--recipes", default="fp16,bf16,bf16-pure,bf16-sr")
    ap.add_argument("--modes", default="eager,compiled,compile_step")
    ap.add_argument("--optimizers", default="foreach,fused", help="AdamW flavours: foreach, fused or both")
    ap.add_argument("--pairs", type=int, default=None, help="timed interleaved pairs per row (15; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side (compiled rows: at least 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="tiny models and 3 pairs: a smoke test")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table as markdown to PATH (after each row)")
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend of the compiled rows (aot_eager: a quick check of the code path)")
    args = ap.parse_args()
    args.pairs = args.pairs if args.pairs is not None else (3 if args.quick else 15)
    split = lambda s: [v for v in s.split(",") if v]
    models, recipes, modes, optimizers = (split(args.models), split(args.recipes), split(args.modes),
                                          split(args.optimizers))
    for what, given, known in (("--models", models, SIZES), ("--modes", modes, ("eager", "compiled", "compile_step")),
                               ("--optimizers", optimizers, ("foreach", "fused"))):
        if not given or not set(given) <= set(known):
            ap.error(f"{what} takes a comma list of {', '.join(known)}; got {','.join(given)!r}")
    for recipe in recipes:
        try:
            mixprec.get_recipe(recipe)
        except (KeyError, ValueError) as e:
            ap.error(f"--recipes: {e}")
    if args.pairs < 1 or args.warmup < 0:
        ap.error("--pairs must be at least 1 and --warmup at least 0")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    print(header(args, device))
    print("ratio = mixprec / torch.amp per interleaved pair (< 1: mixprec faster); ms = median per step; "
          "ops = aten ops per eager step\n")
    print("".join(f"{name:<{w}}" for name, w in COLUMNS), flush=True)
    rows, failed = [], 0
    for model_name in models:
        for mode in modes:
            # compile_step needs a fused optimizer: one row per recipe, fused AdamW on both sides.
            for optimizer in (["fused"] if mode == "compile_step" else optimizers):
                for recipe in recipes:
                    cells = [model_name, mode, optimizer, recipe]
                    try:
                        cells += run_row(model_name, mode, optimizer, recipe, args, device)
                    except Exception as e:      # a failing row is reported, the others still run
                        failed += 1
                        cells += [f"error: {type(e).__name__}: {e}".splitlines()[0][:160]]
                    rows.append(cells)
                    print("".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS)), flush=True)
                    if args.markdown:          # after every row: a run stopped by a time limit keeps its rows
                        write_markdown(args.markdown, header(args, device), rows)
    if args.markdown:
        print(f"\nmarkdown table written to {args.markdown}")
    if failed:
        print(f"\n{failed} row(s) failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
