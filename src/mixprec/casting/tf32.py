"""TF32 for the two fp32 recipes: set for their forward and backward, restored after; never read
through torch's legacy flags.

``fp32`` means IEEE fp32 matmuls and convolutions (the reference), ``tf32`` means both on tensor cores
with a 10-bit mantissa. Torch's own defaults are neither: cuBLAS matmuls IEEE, cuDNN convolutions
TF32. So for these recipes the engine sets cuBLAS matmuls and cuDNN convolutions (and RNNs) for the
forward (``mp.autocast()``) and the backward (``mp.backward()``), and gives the user's settings back
after each. A backward a trainer runs itself (``scale_loss``) keeps the user's settings.

The low-precision recipes touch nothing, as ``torch.autocast`` does not: their matmuls run in 16 or
8 bits anyway, and an fp32 matmul the user left outside autocast runs as the user set it, so the
numbers are the torch.amp loop's.

Only the ``fp32_precision`` API (torch 2.9 and later) is read and written. Reading the legacy
``torch.backends.cuda.matmul.allow_tf32`` raises once a program has set the new one ("mix of the
legacy and new APIs"), as PyTorch's notes now advise users to; values written here and restored are
the new API's own, which keeps either API readable for the user afterwards.

    >>> with fp32_precision(tf32=False):
    ...     torch.backends.cuda.matmul.fp32_precision
    'ieee'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["fp32_precision"]


def _knobs() -> tuple:
    backends = torch.backends
    return backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn


@contextlib.contextmanager
def fp32_precision(tf32: bool) -> Iterator[None]:
    """fp32 matmuls and convolutions in TF32 (``tf32=True``) or IEEE fp32 inside; as before after."""
    knobs = _knobs()
    saved = [k.fp32_precision for k in knobs]
    value = "tf32" if tf32 else "ieee"
    for k in knobs:
        k.fp32_precision = value
    try:
        yield
    finally:
        for k, was in zip(knobs, saved):
            k.fp32_precision = was
