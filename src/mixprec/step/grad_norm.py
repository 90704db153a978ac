"""The step's global gradient norm in fp32: one read of every gradient, 16-bit ones without fp32 copies.

``step()`` must know the norm of the gradients (is any of them inf or NaN? by how much to clip?) before
the optimizer moves a single weight. Under a pure recipe the optimizer steps fp32 copies chunk by chunk
(``update/chunks.py``), so the fp32 casts of the gradients exist one chunk at a time: the norm must read the
16-bit gradients themselves.

- CUDA: one ``_foreach_norm`` launch per dtype reads 16-bit and fp32 gradients and accumulates in fp32.
- CPU, a 16-bit gradient of at least ``_COMPILED_MIN`` (2**20) elements: one loop compiled by torch's
  own compiler (``fusion.FusedFunction``, once per process and dtype, ~3 s) reads the 16-bit values,
  squares them in fp32 and sums them, at memory speed and without an fp32 copy (16M bf16 values: 3.3
  ms, where a cast and a BLAS dot take 4.9 ms). ATen's own norm kernels on 16-bit input were measured
  10x slower (``_foreach_norm``: 41 ms).
- CPU, one process, gradients that fit one block together (a small model: at most ``block`` elements
  in all, dense or sparse): ``global_norm_f32``, one ``_foreach_norm`` and the norm of the norms, three
  ops. At these sizes the ops' dispatch is the cost, not the reading: the tiny benchmark model's six gradients take
  40-54 us this way against 116 us cast into a scratch and dotted (1 thread; 1M 16-bit values: 290-380
  against 320-480), and the compiled step and CUDA read them the same way.
- CPU otherwise (larger models, or where the compiler is missing): each block of at most ``block``
  (2**20) elements is cast into one small fp32 scratch (4 MiB at most, it stays in cache; made once
  per call and freed before the chunks are cast, so the step's peak does not grow) and dotted there by
  BLAS; an fp32 gradient is dotted where it lies. Casting a whole gradient into fresh fp32 memory
  instead pays that memory's page faults at every step.

Bits. The caller hands the same tensors whatever the chunking (the model's 16-bit gradients, never
their fp32 casts), and which way they are read depends on their sizes and dtypes alone, as does each
tensor's sum: ``_foreach_norm`` reduces by index, not by address; the compiled loop's
order is fixed by the size, and MKL's ``sdot``, which rounds differently at different address
alignments (measured: the same values at two offsets give sums one ulp apart), is only run on 64-byte
aligned fp32 buffers (an fp32 gradient in place if it is aligned, anything else through the scratch,
whose start is). So a chunked step clips and skips exactly as a one-call step. The per-tensor sums are
added in fp32 in the order of ``grads``, unscaled, as ``clip_grad_norm_`` adds them: the sum of squares
overflows fp32 (the norm is inf) when the gradients' norm is above sqrt(fp32 max) = 1.8e19 even if every
gradient is finite, and the step treats that as an overflow (docs/step.md). A scaled sum (divided by the
largest magnitude first) would cost a second read of every gradient, or a host sync, in every step.

    >>> g = torch.full((3,), 2.0, dtype=torch.float16)
    >>> GradNorm()([g]).item()      # sqrt(3 * 2**2)
    3.464...
"""

from __future__ import annotations

import torch

from ..fusion import FusedFunction
from .grad_sync import GradSync, SyncKind, local_shard

__all__ = ["GradNorm", "global_norm_f32"]

# Elements per CPU block: 4 MiB of fp32 scratch. Measured on 16M fp16 values (1 thread): blocks of
# 2**16 cost 8.0 ms (Python per block), 2**18 4.5 ms, 2**20 4.0 ms; a whole-tensor cast and dot 7.2 ms.
_BLOCK = 2**20
_ALIGN = 64          # bytes: the CPU allocator's alignment, and a cache line
# 16-bit gradients this large go through the compiled loop: a model with such tensors steps for tens
# of ms on a CPU, next to which the one compile is small; smaller models never compile anything.
_COMPILED_MIN = 2**20


def _sum_squares_f32(g16: torch.Tensor) -> torch.Tensor:
    x = g16.float()       # exact; the compiler fuses the cast into the reduction: no fp32 copy is made
    return (x * x).sum()  # squares exact in fp32 (2 x 11 or 2 x 8 significant bits) inside its range


_fused_sum_squares = FusedFunction(_sum_squares_f32, "16-bit sum of squares")


def global_norm_f32(grads: list[torch.Tensor], sync: GradSync | None = None) -> torch.Tensor:
    """Global L2 norm in fp32, one read of every gradient; inf or NaN if some gradient is, or above 1.8e19.

    The norm of the gradients the optimizer itself holds (fp32, or 16-bit where the model is). In one
    process: one multi-tensor ``_foreach_norm`` reads everything (one launch on CUDA, one aten op on a
    CPU: three ops in all, where a dot per tensor took two per tensor), then the norm of the norms, as
    ``torch.nn.utils.clip_grad_norm_`` computes it (bit for bit). On this CPU it also reads faster than
    per-tensor BLAS dots (3.2M fp32 values: 1.36-1.41 ms against 1.64-1.66; 19M: 5.7-6.3 against
    6.5-6.7). Across ranks (``sync``) each rank sums the squares of the part it holds (a DTensor's local
    shard) and one all_reduce combines them (mixprec.distributed), so every rank gets the same norm.
    """
    if sync is None or sync.kind is SyncKind.LOCAL:
        try:
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        except (NotImplementedError, RuntimeError):
            if not any(g.is_sparse for g in grads):
                raise
            # Sparse gradients (nn.Embedding(sparse=True)): no multi-tensor norm takes them. Only this
            # failed first call pays the check; dense steps never look.
            return global_norm_f32(_dense_values(grads), sync)
    grads = _dense_values(grads) if any(g.is_sparse for g in grads) else grads
    if sync.fsdp:
        grads = [local_shard(g) for g in grads]       # DTensor -> this rank's shard
    if grads[0].device.type != "cpu":
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
    else:
        sq = torch.stack([torch.dot(g.reshape(-1).float(), g.reshape(-1).float()) for g in grads]).sum()
    return sync.reduce_sum_squares(sq).sqrt()


def _dense_values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sparse gradient replaced by its coalesced values (a 1-D dense tensor): the norm of a sparse
    tensor is that of its values once duplicate indices are summed (coalesce adds them, as the dense
    gradient would). Dense gradients are passed through."""
    return [g.coalesce()._values() if g.is_sparse else g for g in grads]


def _fits_one_block(grads: list[torch.Tensor], block: int) -> bool:
    """Whether ``grads`` hold at most ``block`` elements in all (a small model), every one strided or
    sparse COO (whose coalesced values ``global_norm_f32`` reads, as the dense gradient's)."""
    total = 0
    for g in grads:
        if g.layout not in (torch.strided, torch.sparse_coo):
            return False
        total += g.numel()
    return total <= block


class GradNorm:
    """The norm of a pure recipe's gradients (16-bit and fp32 mixed), read without fp32 copies.

    ``scratch_bytes`` says how much CPU scratch the last call used (at most ``4 * block`` bytes, freed
    at its end). Called with ``sync`` the squares are summed across ranks first
    (``GradSync.reduce_sum_squares``). No host sync.
    """

    def __init__(self, block: int = _BLOCK, *, compiled: bool = True) -> None:
        if not (isinstance(block, int) and block > 0 and block % (_ALIGN // 4) == 0):
            raise ValueError(f"block must be a positive multiple of {_ALIGN // 4} elements (so every "
                             f"block starts {_ALIGN}-byte aligned), e.g. {_BLOCK}; got {block!r}")
        self.block = block
        self.compiled = compiled    # False: the scratch for every 16-bit gradient (no compiler)
        self._scratch: torch.Tensor | None = None   # during a call only
        # The last call's gradients (shape, dtype, layout) and whether they fit one block: asked once.
        self._small_key: list | None = None
        self._small = False
        self.scratch_bytes = 0

    def __call__(self, grads: list[torch.Tensor], sync: GradSync | None = None) -> torch.Tensor:
        """The global L2 norm of ``grads`` in fp32 (a () tensor); inf or NaN if some gradient is, or above 1.8e19."""
        if not grads:
            raise ValueError("GradNorm needs at least one gradient")
        local = sync is None or sync.kind is SyncKind.LOCAL
        small = local and self._fits(grads)
        if grads[0].device.type != "cpu" or torch.compiler.is_compiling() or small:
            # One launch reads every dtype (CUDA); a compiled graph fuses the casts into its reduction;
            # a small model's few small gradients cost their ops' dispatch, which three ops keep low.
            self.scratch_bytes = 0
            return global_norm_f32(grads, sync)
        try:
            squares = [sq for g in grads for sq in self._block_squares(g)]
        finally:
            self.scratch_bytes = 0 if self._scratch is None else 4 * self._scratch.numel()
            self._scratch = None      # freed before the step casts its chunks into fp32
        sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32)
        if sync is not None and sync.kind is not SyncKind.LOCAL:
            sq = sync.reduce_sum_squares(sq)
        return sq.sqrt()

    def _fits(self, grads: list[torch.Tensor]) -> bool:
        """``_fits_one_block``, worked out again only when the gradients' shapes, dtypes or layouts change."""
        key = [(g.shape, g.dtype, g.layout) for g in grads]
        if self._small_key != key:
            self._small_key, self._small = key, _fits_one_block(grads, self.block)
        return self._small

    def _block_squares(self, g: torch.Tensor) -> list[torch.Tensor]:
        if g.is_sparse:       # nn.Embedding(sparse=True): the coalesced values carry the whole norm
            g = g.coalesce()._values()
        flat = g.reshape(-1)      # a view of a contiguous gradient; a strided one is copied (aligned)
        n = flat.numel()
        if (self.compiled and flat.dtype != torch.float32 and n >= _COMPILED_MIN
                and _fused_sum_squares.broken is None):
            return [_fused_sum_squares(flat)]
        in_place = flat.dtype == torch.float32 and flat.data_ptr() % _ALIGN == 0
        scratch = None if in_place else self._scratch_for(n, flat.device)
        out = []
        for start in range(0, n, self.block):
            k = min(self.block, n - start)
            if in_place:
                block = flat[start:start + k]      # 4 * block bytes apart: each block stays aligned
            else:
                block = scratch[:k]
                block.copy_(flat[start:start + k])   # 16-bit -> fp32 is exact: the same values
            out.append(torch.dot(block, block))
        return out

    def _scratch_for(self, n: int, device: torch.device) -> torch.Tensor:
        need = min(n, self.block)
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32, device=device)
            assert self._scratch.data_ptr() % _ALIGN == 0, "the CPU allocator aligns to 64 bytes"
        return self._scratch
