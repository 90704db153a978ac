"""Small tensors counted together: one copy each into a shared buffer, one counting call for all of them.

Counting a tensor costs a fixed overhead (a compiled call or a dozen eager kernels, a ``bincount``, the
amax: tens of microseconds on a CPU, a dozen launches on a GPU) plus a little per value. For the many
small activations and gradients of a model (biases, norms, small layers) the overhead is the cost.
:class:`SmallTensorBatch` copies each small tensor into one fp32 buffer (one kernel: the copy; two
with a scale) and, when the buffer is full or :meth:`~SmallTensorBatch.flush` is called, counts all of
them with one :meth:`RangeHistogram.add_segments`: the same numbers as a ``hist.add`` each.

Copying also takes the values as they are *now*: a later in-place op on the tensor (``ReLU(inplace=True)``
after a ``Linear``) cannot change what is counted. Large tensors are counted at once, as before.

    >>> a, b = RangeHistogram("cpu"), RangeHistogram("cpu")
    >>> batch = SmallTensorBatch("cpu")
    >>> batch.add(a, torch.tensor([1.0, 0.0]))
    >>> batch.add(b, torch.tensor([2.0**-20], dtype=torch.float16), scale=torch.tensor(2.0**-16))
    >>> batch.pending, a.result().count       # nothing counted yet
    (2, 0)
    >>> batch.flush()                           # 2**-20 * 2**-16 in fp32: fp16 would flush it
    >>> a.result().zeros, b.result().exponent_counts()
    (1, {-36: 1})
"""

from __future__ import annotations

import torch

from .range_histogram import RangeHistogram

__all__ = ["SmallTensorBatch"]

# Tensors up to this many values are batched. CPU: a counting call costs ~9 us fixed with the C counter
# and ~35-70 us with eager ops, the copy ~0.2 ns per value (measured, benchmarks/HISTORY.md); CUDA: a counting call is ~10 launches
# (~5 us each) while copying 2**20 values takes ~3 us at HBM speed (reasoned; owed to a GPU run).
_BATCH_MAX = {"cpu": 1 << 16, "cuda": 1 << 20}
_CAPACITY = 1 << 21      # values in the buffer (8 MiB fp32); a full buffer is counted and reused


class SmallTensorBatch:
    """Collects small tensors for :class:`RangeHistogram` on ``device``; counts them on :meth:`flush`. No sync."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_values = _BATCH_MAX.get(self.device.type, 1 << 16)
        self._buffer: torch.Tensor | None = None     # made on first use
        self._hists: list[RangeHistogram] = []
        self._sizes: list[int] = []
        self._used = 0

    @property
    def pending(self) -> int:
        """How many tensors wait in the buffer."""
        return len(self._hists)

    def add(self, hist: RangeHistogram, x: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Count ``x`` (times ``scale``) into ``hist``: now if it is large, else at the next flush. No sync.

        As ``hist.add(x, scale)``: the copy to fp32 is exact for 16-bit and fp8 values (float64
        rounds), and the scale multiplies in fp32 after it, the one rounding ``add`` makes.
        """
        n = x.numel()
        if self._buffer is None and x.device.type == self.device.type:
            # Made on x's device: "cuda" and "cuda:0" name one device but do not compare equal.
            self._buffer = torch.empty(_CAPACITY, dtype=torch.float32, device=x.device)
        if n > self.max_values or self._buffer is None or x.device != self._buffer.device:
            hist.add(x, scale)
            return
        if self._used + n > _CAPACITY:
            self.flush()
        dst = self._buffer[self._used:self._used + n]
        dst.copy_(x.detach().reshape(-1))
        if scale is not None:
            dst.mul_(scale)
        self._hists.append(hist)
        self._sizes.append(n)
        self._used += n

    def flush(self) -> None:
        """Count everything waiting, one ``add_segments`` for all. No sync."""
        if not self._hists:
            return
        hists, sizes, used = self._hists, self._sizes, self._used
        self._hists, self._sizes, self._used = [], [], 0
        RangeHistogram.add_segments(hists, self._buffer[:used], sizes)
