"""Export a model's weights in fp32, whatever precision the recipe holds them in.

Under pure recipes the model's own ``state_dict()`` is 16-bit (fp16-pure, bf16-pure, bf16-sr), and the
exact weights the optimizer updates live in the fp32 master copy (``mp.state_dict()["master"]``, a
list, not keyed by name). ``fp32_state_dict`` gives what an fp32 model loads::

    torch.save(mp.fp32_state_dict(), "model_fp32.pt")        # or mixprec.fp32_state_dict(mp)
    fp32_model.load_state_dict(torch.load("model_fp32.pt"))

Each low-precision parameter with a master copy is replaced by that copy (the fp32 weights, not the
rounded 16-bit ones); every other floating tensor is upcast to fp32, which is exact (fp16 and bf16
values are all fp32 values). Integer buffers stay as they are. Like ``state_dict()`` the tensors are
detached views of live state where no cast was needed: clone them if training goes on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["fp32_state_dict"]


def fp32_state_dict(engine: Any) -> OrderedDict[str, torch.Tensor]:
    """The model's ``state_dict()`` with master weights in place of 16-bit ones, all floats in fp32."""
    state = engine.model.state_dict()
    master = engine.master
    if master is not None and master.keep:
        name_of = {id(p): name for name, p in engine.model.named_parameters()}
        for p, m in zip(master.model_params, master.masters):
            name = name_of.get(id(p))
            if name is not None and name in state:
                state[name] = m.detach()
    return OrderedDict((k, v.float() if v.is_floating_point() and v.dtype != torch.float32 else v)
                       for k, v in state.items())
