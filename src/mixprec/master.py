"""fp32 copies of low-precision weights that the optimizer updates in their place.

An fp16 weight cannot absorb an update smaller than half its ulp: with |w| / |update| > 2048 the sum
rounds back to w and the update is lost (fp16 keeps 11 significant bits, so 1 + 2**-12 == 1). So the user's optimizer is pointed at fp32 copies:
the low-precision gradients are cast into the copies' ``.grad``, the optimizer steps there (its state is
fp32 too) and the result is rounded back into the model.

Two lifetimes, one mechanism:

- ``keep=True`` (fp16-pure, bf16-pure): the fp32 copy persists between steps: a master copy, +4 B/param.
- ``keep=False`` (bf16-sr): the copy lives only during the step, made from the bf16 weights and
  rounded back *stochastically*, so an update below half an ulp survives in expectation. The optimizer
  state stays fp32; no master copy is held.

    >>> w = torch.full((100_000,), 1.0)
    >>> stochastic_round_bf16(w + 2**-10, torch.Generator().manual_seed(0)).float().mean().item()
    1.0009...
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .recipe import Rounding

__all__ = ["MasterWeights", "stochastic_round_bf16"]


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down with probabilities that make the result unbiased.

    bf16 is fp32 with the low 16 mantissa bits dropped. Adding a uniform integer in [0, 2**16) to the
    bit pattern and then truncating those bits carries into bit 16 with probability equal to the
    dropped fraction of an ulp, for either sign (the low bits are magnitude bits). NaN stays NaN.
    """
    assert x.dtype == torch.float32, "stochastic rounding reads the fp32 bit pattern"
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # -65536 == 0xFFFF0000 as int32: clears the 16 bits bf16 does not hold, so .to(bf16) below is exact.
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


class MasterWeights:
    """fp32 stand-ins for low-precision parameters inside the user's optimizer.

    On construction the optimizer's references to ``params`` (still fp32 at that moment) are replaced
    by fp32 clones, and existing optimizer state moves with them. Call ``pull_grads`` before the
    optimizer step and ``push_weights`` after it.
    """

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, *,
                 keep: bool, rounding: Rounding = Rounding.NEAREST, seed: int = 0) -> None:
        self.model_params = list(params)
        self.keep = keep
        self.rounding = rounding
        # Clone before the model is cast: the master starts as the exact fp32 initial weights.
        self.masters = [nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                        for p in self.model_params]
        by_id = {id(p): m for p, m in zip(self.model_params, self.masters)}
        for group in optimizer.param_groups:
            group["params"] = [by_id.get(id(p), p) for p in group["params"]]
        for p in self.model_params:
            if p in optimizer.state:
                optimizer.state[by_id[id(p)]] = optimizer.state.pop(p)
        self.generator: torch.Generator | None = None
        if rounding is Rounding.STOCHASTIC:
            device = self.masters[0].device if self.masters else torch.device("cpu")
            self.generator = torch.Generator(device=device).manual_seed(seed)
        if not keep:
            self._release()

    def pull_grads(self) -> None:
        """Cast the model's low-precision gradients into the fp32 copies (and, transient, the weights).

        Casting fp16/bf16 to fp32 is exact, so the overflow check on the copies sees what backward made.
        """
        for p, m in zip(self.model_params, self.masters):
            if not self.keep:
                m.data = p.detach().float()
            if p.grad is None:
                m.grad = None
            elif m.grad is None or m.grad.shape != p.grad.shape:
                m.grad = p.grad.float()
            else:
                m.grad.copy_(p.grad)

    @torch.no_grad()
    def push_weights(self) -> None:
        """Round the fp32 copies into the model's weights (nearest, or stochastic for bf16-sr).

        Rounding an unchanged copy gives back the model's weight bit for bit, so this is safe to run
        after a step the optimizer skipped on the device.
        """
        if self.generator is None:
            torch._foreach_copy_([p.data for p in self.model_params], [m.data for m in self.masters])
        else:
            for p, m in zip(self.model_params, self.masters):
                p.data.copy_(stochastic_round_bf16(m.data, self.generator))
        if not self.keep:
            self._release()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.masters:
            if set_to_none:
                m.grad = None
            elif m.grad is not None:
                m.grad.zero_()

    def _release(self) -> None:
        # A transient copy gives its memory back between steps; the optimizer keys state by the
        # Parameter object, which stays.
        for m in self.masters:
            m.data = torch.empty(0, dtype=torch.float32, device=m.device)
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().clone() for m in self.masters] if self.keep else None,
                "generator": self.generator.get_state() if self.generator is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state.get("masters")
        if self.keep:
            if masters is None or len(masters) != len(self.masters):
                raise ValueError(f"master state holds {0 if masters is None else len(masters)} tensors, "
                                 f"this model has {len(self.masters)} low-precision parameters: was it "
                                 "saved from a different model or recipe?")
            for m, saved in zip(self.masters, masters):
                if m.shape != saved.shape:
                    raise ValueError(f"master weight shape {tuple(saved.shape)} in the state does not "
                                     f"match the model's {tuple(m.shape)}")
                m.data.copy_(saved)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])
