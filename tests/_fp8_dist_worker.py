"""What each rank runs for test_fp8_fsdp.py: a small transformer under FSDP2 + fp8, every scenario in one spawn.

Each scenario trains ``TinyLM`` (2 blocks, width 32, bias-free linears as in Llama, every linear its
own FSDP unit so that its all-gather buffer holds its weight alone and the collective's dtype is the
weight's) on a global batch split evenly across ranks, and records per step: skipped, norm, every
parameter whole, and the bytes each collective carried, by dtype. Faults are planted after backward
on one rank only (the engine's lockstep must make every rank skip).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.distributed import load_distributed_checkpoint, save_distributed_checkpoint, shard_model
from mixprec.fp8.fsdp_weight import gather_scales_of
from mixprec.fp8.scaling import FP8_E4M3, amax_f32, cast_to_fp8, current_scale

VOCAB, WIDTH, SEQ, GLOBAL_BATCH = 64, 32, 8, 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH), Block(WIDTH)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


def fp8_weight_numel(model: nn.Module) -> int:
    """Elements of the weights the fp8 recipe swaps (every linear here: all dims multiples of 16)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def global_batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(n)]


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def build(recipe: str, *, distributed: bool, fp8_all_gather: bool | None = None, own: bool = False,
          device: torch.device = torch.device("cpu")):
    """The engine on TinyLM: on one process, sharded by shard_model, or (``own``) by the user's own
    fully_shard calls, the same units as shard_model's (the engine then swaps the FSDP-held linears)."""
    model = tiny_lm().to(device)
    if own:
        from torch.distributed.fsdp import fully_shard
        for m in [m for m in model.modules() if isinstance(m, nn.Linear)]:
            fully_shard(m)
        fully_shard(model)
    elif distributed:
        shard_model(model, recipe, units=(nn.Linear,), fp8_all_gather=fp8_all_gather)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe,
                                clip_grad_norm=1.0)
    return mp


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for p in model.parameters()]


class Wire:
    """Counts the bytes FSDP2's collectives carry, by dtype: wraps dist.all_gather_single (FSDP2's
    all-gather), dist.reduce_scatter_single (its gradient reduce-scatter) and dist.all_reduce."""

    def __init__(self) -> None:
        self.gathered: collections.Counter = collections.Counter()   # dtype -> bytes assembled on this rank
        self.scattered: collections.Counter = collections.Counter()  # dtype -> bytes sent into reduce-scatter
        self.all_reduces: list[int] = []                               # elements of each all_reduce
        self._orig = {}

    def __enter__(self):
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
            self._orig[name] = getattr(dist, name)
        orig = self._orig

        def all_gather_single(output, input, *a, **k):
            self.gathered[str(output.dtype)] += output.numel() * output.element_size()
            return orig["all_gather_single"](output, input, *a, **k)

        def reduce_scatter_single(output, input, *a, **k):
            self.scattered[str(input.dtype)] += input.numel() * input.element_size()
            return orig["reduce_scatter_single"](output, input, *a, **k)

        def all_reduce(tensor, *a, **k):
            self.all_reduces.append(tensor.numel())
            return orig["all_reduce"](tensor, *a, **k)

        dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = \
            all_gather_single, reduce_scatter_single, all_reduce
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def take(self) -> dict:
        out = {"gathered": dict(self.gathered), "scattered": dict(self.scattered),
               "all_reduces": list(self.all_reduces)}
        self.gathered.clear(), self.scattered.clear(), self.all_reduces.clear()
        return out


def plant(mp, value: float) -> None:
    for p in mp.model.parameters():
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if local is not None and local.numel():
            local.view(-1)[0] = value
            return


def train(mp, batches, rank: int, world: int, *, plants=None, start: int = 0, wire: Wire | None = None):
    plants = plants or {}
    rows = GLOBAL_BATCH // world
    records = []
    for step in range(start, len(batches)):
        ids = batches[step][rank * rows:(rank + 1) * rows].to(next(mp.model.parameters()).device)
        with mp.autocast():
            loss = loss_of(mp.model, ids)
        mp.backward(loss)
        if step in plants and plants[step][0] == rank:
            plant(mp, plants[step][1])
        result = mp.step()
        mp.zero_grad()
        rec = {"skipped": bool(result.skipped_t), "norm": float(result.grad_norm_t)}
        if wire is not None:
            rec["wire"] = wire.take()     # before full_params: its own all-gathers are not the step's
        rec["params"] = full_params(mp.model)
        records.append(rec)
    return records


def gathered_weights_match(mp) -> dict[str, bool]:
    """Per fp8 layer: is the e4m3 weight FSDP2 gathered bit for bit the 1-process cast of the whole
    weight (same scale, same bytes)? The whole weight comes from full_tensor() (an fp32 gather)."""
    expect, seen = {}, {}
    for name, m in mp.model.named_modules():
        if hasattr(m, "fp8_config"):
            w = m.weight.full_tensor().detach()
            scale = current_scale(amax_f32(w), FP8_E4M3)
            expect[name] = (cast_to_fp8(w, scale, FP8_E4M3), scale)
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.update(
                {name: [t.clone() for t in mod.weight.fp8_weight()]}))    # FSDP frees the gathered storage after
    with torch.no_grad(), mp.autocast():
        loss_of(mp.model, global_batches(1)[0][:2].to(next(mp.model.parameters()).device))
    return {n: n in seen and torch.equal(seen[n][0].view(torch.uint8), q.view(torch.uint8))
            and torch.equal(seen[n][1], s) for n, (q, s) in expect.items()}


def messages() -> dict[str, str]:
    """The ValueError (or the report line) each misuse gives under a live group."""
    def message(fn) -> str:
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return "no error"

    out = {name: message(lambda r=recipe: shard_model(tiny_lm(), r, fp8_all_gather=True))
           for name, recipe in (("block", "fp8-block"), ("rowwise", "fp8-rowwise"), ("bf16", "bf16"))}
    # The default falls back, and says so per layer: rowwise trains with the weight gathered in fp32.
    mp = build("fp8-rowwise", distributed=True)
    out["rowwise_report"] = str(mp.fp8_report)
    out["rowwise_scales"] = repr(gather_scales_of(mp.model))
    return out


def worker(rank: int, world: int, out_dir: str, scenarios: list[dict], device_type: str = "cpu") -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    results = {}
    for sc in scenarios:
        name = sc["name"]
        if name == "messages":
            results[name] = messages()
            continue
        if name == "gathered":
            results[name] = gathered_weights_match(build("fp8", distributed=True, device=device))
            continue
        batches = global_batches(sc["steps"])
        mp = build(sc["recipe"], distributed=True, fp8_all_gather=sc.get("fp8_all_gather"), own=sc.get("own", False),
                   device=device)
        if "resume_at" not in sc:
            with Wire() as wire:
                results[name] = train(mp, batches, rank, world, plants=sc.get("plants"), wire=wire)
            results[name + ":report"] = str(mp.fp8_report)
            continue
        k, path = sc["resume_at"], f"{out_dir}/ckpt-{name}"
        first = train(mp, batches[:k], rank, world)
        save_distributed_checkpoint(path, mp, extra={"step": k})
        whole = first + train(mp, batches, rank, world, start=k)
        mp2 = build(sc["recipe"], distributed=True, device=device)
        step = load_distributed_checkpoint(path, mp2)["step"]
        results[name] = {"whole": whole[k:], "resumed": train(mp2, batches, rank, world, start=step)}
        dist.barrier()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
