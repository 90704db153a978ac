"""What each rank runs for test_distributed.py (and tests/gpu/test_nccl.py): every scenario in one spawn.

Process start-up and group init cost seconds, so one ``run_processes`` call runs all scenarios and each
rank saves its records to ``out/rank{r}.pt``; the test process compares them. A scenario trains the
tiny model on a global batch of 32 split evenly across ranks, so a 1-rank run on the whole batch is the
reference. Faults are planted *after* backward, on one rank only, where DDP's all-reduce cannot carry
them to the other rank: only the engine's own reduction can make that rank skip.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.distributed import load_distributed_checkpoint, save_distributed_checkpoint
from mixprec.distributed import shard_model, wrap_ddp

GLOBAL_BATCH = 32


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 5))


def global_batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g) * 3, torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))
            for _ in range(n)]


OPTIMIZERS = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),     # the no-sync fused path
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),              # the generic path
}


def build(kind: str, recipe: str, optimizer: str, device: torch.device, *, comm: str | None = None,
          local: bool = False, clip: float | None = 1.0):
    """(engine, module to call forward on) for ``kind`` in ddp | fsdp | single."""
    model = tiny_model().to(device)
    if kind == "fsdp":
        shard_model(model, recipe, comm_dtype=comm)
    opt = OPTIMIZERS[optimizer](model.parameters())
    mp = mixprec.MixedPrecision(model, opt, recipe, clip_grad_norm=clip,
                                process_group=None if local or kind == "single" else "auto")
    forward = wrap_ddp(mp, comm_dtype=comm) if kind == "ddp" and not local else model
    if kind == "ddp" and local:   # the negative control: DDP averages, the engine does not share
        forward = nn.parallel.DistributedDataParallel(model)
    return mp, forward


def full_params(model: nn.Module | list[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter whole, fp32-exact, on the CPU (a DTensor is gathered)."""
    out = []
    for p in (model.parameters() if isinstance(model, nn.Module) else model):
        p = p.detach()
        if hasattr(p, "full_tensor"):
            p = p.full_tensor()
        out.append(p.float().cpu().clone())
    return out


def masters(mp) -> list[torch.Tensor]:
    if mp.master is None or not mp.master.keep:
        return []
    return [m.detach().cpu().clone() for m in mp.master.masters]


def plant(mp, value: float) -> None:
    """Put ``value`` into one gradient element this rank holds (after backward, after DDP's reduce)."""
    for p in mp.model.parameters():
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if local.numel():
            local.view(-1)[0] = value
            return


def _no_sync(forward, first_of: bool):
    """DDP's no_sync() / FSDP2's set_requires_gradient_sync(False) for all but the last micro-batch."""
    if isinstance(forward, nn.parallel.DistributedDataParallel) and first_of:
        return forward.no_sync()
    if hasattr(forward, "set_requires_gradient_sync"):
        forward.set_requires_gradient_sync(not first_of)
    return contextlib.nullcontext()


def train(mp, forward, batches, rank: int, world: int, device, *, plants=None, start: int = 0,
          accum: int = 1):
    """Train on ``batches[start:]``; record after every step. ``plants``: {step: (rank, value)}.

    ``accum=K`` splits each rank's rows into K micro-batches (loss / K each); the reduction across
    ranks runs only with the last one's backward, as users write gradient accumulation.
    """
    plants = plants or {}
    rows = GLOBAL_BATCH // world
    micro = rows // accum
    records = []
    for step in range(start, len(batches)):
        x, y = batches[step]
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        for k in range(accum):
            with _no_sync(forward, k < accum - 1):
                with mp.autocast():
                    loss = F.cross_entropy(forward(x[k * micro:(k + 1) * micro]),
                                           y[k * micro:(k + 1) * micro]) / accum
                mp.backward(loss)
        if step in plants and plants[step][0] == rank:
            plant(mp, plants[step][1])
        result = mp.step()
        mp.zero_grad()
        records.append({"skipped": bool(result.skipped_t), "scale": float(result.scale_t),
                        "norm": float(result.grad_norm_t), "params": full_params(mp.model),
                        "masters": masters(mp),
                        # What the optimizer updates, in model order: fp32 masters where there are any.
                        "stepped": full_params([p for g in mp.optimizer.param_groups for p in g["params"]])})
    return records


def misuse_messages() -> dict[str, str]:
    """The ValueError each misuse raises under a live process group (the message, or "no error")."""
    from torch.distributed.fsdp import fully_shard

    def message(fn) -> str:
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return "no error"

    def own_fully_shard():
        model = fully_shard(tiny_model())
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-pure")

    def pure_after_ddp():
        model = nn.parallel.DistributedDataParallel(tiny_model())
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-pure")

    def wrong_recipe():
        model = shard_model(tiny_model(), "bf16-pure")
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16-pure")

    plain = tiny_model()
    auto_kind = mixprec.MixedPrecision(plain, torch.optim.SGD(plain.parameters(), lr=0.1), "bf16").grad_sync.kind
    return {"auto_plain_kind": auto_kind.value, "own_fully_shard": message(own_fully_shard), "pure_after_ddp": message(pure_after_ddp),
            "wrong_recipe": message(wrong_recipe)}


def worker(rank: int, world: int, out_dir: str, scenarios: list[dict], device_type: str = "cpu") -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)
    results = {}
    for sc in scenarios:
        if sc["kind"] == "errors":
            results[sc["name"]] = misuse_messages()
            continue
        batches = global_batches(sc.get("steps", 6))
        plants = sc.get("plants")
        mp, forward = build(sc["kind"], sc["recipe"], sc["optimizer"], device, comm=sc.get("comm"),
                            local=sc.get("local", False))
        if "resume_at" not in sc:
            results[sc["name"]] = train(mp, forward, batches, rank, world, device, plants=plants,
                                        accum=sc.get("accum", 1))
            continue
        # Resume: train to resume_at, save, train on (the uninterrupted run); then fresh objects,
        # load, train the rest: the two must agree bit for bit.
        path = f"{out_dir}/ckpt-{sc['name']}"
        k = sc["resume_at"]
        first = train(mp, forward, batches[:k], rank, world, device, plants=plants)
        save_distributed_checkpoint(path, mp, extra={"step": k})
        whole = first + train(mp, forward, batches, rank, world, device, plants=plants, start=k)
        torch.manual_seed(1234 + rank)      # the resume must restore RNG state, not inherit it
        mp2, forward2 = build(sc["kind"], sc["recipe"], sc["optimizer"], device, comm=sc.get("comm"))
        step = load_distributed_checkpoint(path, mp2)["step"]
        resumed = train(mp2, forward2, batches, rank, world, device, plants=plants, start=step)
        results[sc["name"]] = {"whole": whole[k:], "resumed": resumed}
        dist.barrier()
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def sleeper(rank: int, world: int, pid_dir: str) -> None:
    """Writes its pid, then waits far longer than any test: only a terminate ends it (issue 15)."""
    import os
    import time
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
