"""``Fp8Conv1D``: Hugging Face's ``Conv1D`` (GPT-2's linear with a transposed weight) in fp8.

GPT-2, GPT-J-style and other OpenAI-GPT descendants in ``transformers`` build their projections from
``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b`` with ``W`` stored ``(in, out)``, the
transpose of ``nn.Linear``'s ``(out, in)``. It is a linear layer in every numerical sense, so it is
swapped like one: the fp8 layer keeps the very ``weight`` Parameter, ``(in, out)`` as it was (the
optimizer, ``state_dict`` keys and ``save_pretrained`` see no change), and hands the matmul its
transposed view ``W^T``, which is ``(out, in)``. The view costs no copy; its gradient flows back into
the ``(in, out)`` Parameter through autograd's transpose. Per-tensor amax and scales do not depend on
the layout, so the numbers are those of an ``Fp8Linear`` holding ``W^T``.

No import of transformers: a Conv1D is recognised by its class name and module and its ``nf``/``nx``
attributes (``is_hf_conv1d``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..recipe.fp8 import Fp8Config
from .linear import Fp8Linear

__all__ = ["Fp8Conv1D", "is_hf_conv1d"]


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for ``transformers``' ``Conv1D`` (weight ``(nx, nf)`` = (in, out), bias ``(nf,)``)."""
    cls = type(module)
    if cls.__name__ != "Conv1D" or not cls.__module__.startswith("transformers"):
        return False
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


class Fp8Conv1D(Fp8Linear):
    """An fp8 linear over a Conv1D's ``(in, out)`` weight; ``nf``/``nx`` kept as Conv1D has them."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: Fp8Config, backend: str) -> Fp8Conv1D:
        """An Fp8Conv1D holding ``conv``'s very Parameters (no copy)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.nx, layer.nf = conv.nx, conv.nf
        layer.in_features, layer.out_features = conv.nx, conv.nf
        layer.weight = conv.weight                          # (in, out), as Conv1D stores it
        layer.register_parameter("bias", conv.bias)
        layer.train(conv.training)
        layer._setup_fp8(config, backend, layer.weight.device)
        return layer

    def _weight_out_in(self) -> torch.Tensor:
        return self.weight.t()                              # (out, in) view: no copy

    def extra_repr(self) -> str:
        return (f"nf={self.nf}, nx={self.nx} (HF Conv1D, weight (in, out)), bias={self.bias is not None}, "
                f"fp8={self.fp8_config}, backend={self.backend}")
