"""The engine's own AdamW: torch's update, with the two moments held in bf16 or fp8 between steps.

A recipe with ``moments=bf16|bf16-sr|fp8`` (recipe/moments.py) steps with ``CompactAdamW`` instead of
the user's ``torch.optim.Adam``/``AdamW``. The user's optimizer stays the source of the hyperparameters
(``lr``, ``betas``, ``eps``, ``weight_decay`` of each param group, so LR schedulers keep working) and is
never stepped; its ``state`` stays empty. Per tensor, one step is::

    m, v = decode(m_stored), decode(v_stored)            # fp32 transients of one tensor
    w  *= 1 - lr * wd                                    # AdamW (Adam: g += wd * w)
    m   = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    w  -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    m_stored, v_stored = encode(m), encode(v)            # rounded: nearest or stochastic

which is torch's single-tensor Adam (``foreach=False``) operation for operation, so with fp32 storage
(``Moments.FP32``, used by the tests) the weights match torch bit for bit. The step count is a Python
int per tensor (torch keeps an fp32 tensor). No host sync; the engine skips non-finite steps itself.

    >>> w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.AdamW([w], lr=0.1)
    >>> adam = CompactAdamW(opt, Moments.BF16_SR); w.grad = torch.full((4,), 0.5); adam.step()
    >>> w.detach()           # first Adam step: -lr * sign(g), after weight decay 1 - 0.1 * 0.01
    tensor([0.8990, 0.8990, 0.8990, 0.8990])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .stochastic_rounding import stochastic_round_bf16
from ..recipe.moments import FP8_BLOCK, Moments

__all__ = ["CompactAdamW", "encode_moment", "decode_moment", "moment_bytes"]

_E4M3_MAX = 448.0            # largest finite float8_e4m3fn
_E4M3_MIN_NORMAL = 2.0 ** -6  # below it e4m3 has a fixed grid: multiples of 2**-9 (subnormals)


def moment_bytes(fmt: Moments, numel: int) -> int:
    """Bytes one moment of ``numel`` elements takes in ``fmt`` (fp8: padded blocks plus their scales)."""
    if fmt is Moments.FP8:
        blocks = -(-numel // FP8_BLOCK)
        return blocks * FP8_BLOCK + 4 * blocks
    return numel * (4 if fmt is Moments.FP32 else 2)


def _sr_e4m3(y: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` in [-448, 448] rounded stochastically onto the e4m3 grid (exact in float8_e4m3fn).

    Normal range: e4m3 keeps 3 of fp32's 23 mantissa bits; adding a uniform integer in [0, 2**20) to the
    bit pattern and clearing the low 20 bits rounds the magnitude up with probability equal to the
    dropped fraction of an ulp (stochastic_rounding.stochastic_round_bf16's trick with 20 bits instead of 16). Below
    2**-6 the grid is fixed (step 2**-9): floor(y * 512 + u) / 512 with u = noise / 2**20 in [0, 1).
    """
    normal = ((y.view(torch.int32) + noise) & -(1 << 20)).view(torch.float32)
    u = noise.to(torch.float32) * 2.0 ** -20
    fine = torch.floor(y * 512.0 + u) * (1.0 / 512.0)       # both factors powers of two: exact
    # A value just under 448 may round up to 480, which e4m3fn does not hold: clamp to its largest.
    return torch.where(y.abs() < _E4M3_MIN_NORMAL, fine, normal).clamp_(-_E4M3_MAX, _E4M3_MAX)


def encode_moment(x: torch.Tensor, fmt: Moments, generator: torch.Generator | None) -> Any:
    """fp32 ``x`` in ``fmt``: a tensor (fp32, bf16) or, for fp8, ``(e4m3 codes, fp32 scale per block)``."""
    if fmt is Moments.FP32:
        return x
    if fmt is Moments.BF16:
        return x.to(torch.bfloat16)                     # round to nearest even
    if fmt is Moments.BF16_SR:
        return stochastic_round_bf16(x, generator)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % FP8_BLOCK
    blocks = F.pad(flat, (0, pad)).view(-1, FP8_BLOCK)   # (n_blocks, 128)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # Per block, the largest magnitude maps onto e4m3's largest finite value; an all-zero block keeps
    # scale 1 (its codes are zeros). The stored scale is the decode factor amax / 448.
    inv_scale = torch.where(amax > 0, amax / _E4M3_MAX, torch.ones_like(amax))
    y = (blocks / inv_scale).clamp_(-_E4M3_MAX, _E4M3_MAX)
    noise = torch.randint(0, 1 << 20, y.shape, dtype=torch.int32, device=y.device, generator=generator)
    return _sr_e4m3(y, noise).to(torch.float8_e4m3fn), inv_scale.reshape(-1)


def decode_moment(stored: Any, fmt: Moments, like: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a stored moment, shaped like ``like`` (a fresh tensor: safe to update)."""
    if fmt is Moments.FP32:
        return stored
    if fmt is not Moments.FP8:
        return stored.float()                           # bf16 -> fp32 is exact
    codes, inv_scale = stored
    values = codes.float().view(-1, FP8_BLOCK) * inv_scale[:, None]   # e4m3 -> fp32 exact, one rounding
    return values.reshape(-1)[:like.numel()].view_as(like)


class CompactAdamW:
    """Adam/AdamW with moments stored in ``fmt``, stepping ``optimizer``'s params with its hyperparameters.

    ``step()`` updates every tensor of ``optimizer.param_groups`` that has a gradient (fp32 tensors and
    fp32 gradients: the model's fp32 weights or the engine's fp32 copies). Moments start at zero. The
    second moment is encoded as ``sqrt(v)`` in fp8 (its dynamic range halves) and as ``v`` otherwise.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fmt: Moments, *, seed: int = 0,
                 numel: Callable[[torch.Tensor], int] = torch.Tensor.numel) -> None:
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"moments={fmt.value} needs torch.optim.Adam or AdamW (the engine runs its own "
                             f"AdamW with compact moments), got {type(optimizer).__name__}; use moments=fp32 "
                             "with other optimizers")
        for group in optimizer.param_groups:
            bad = [k for k in ("amsgrad", "maximize", "differentiable") if group.get(k)]
            if bad:
                raise ValueError(f"moments={fmt.value} supports plain Adam/AdamW; this optimizer sets "
                                 f"{', '.join(bad)}=True: drop it, or use moments=fp32")
            if any(isinstance(v, torch.Tensor) for v in (group["lr"], *group["betas"])):
                raise ValueError(f"moments={fmt.value} reads lr and betas as Python numbers; build the "
                                 "optimizer with float lr and betas")
        if any(optimizer.state.values()):
            raise ValueError(f"the optimizer already holds state (it has stepped): build MixedPrecision with "
                             f"moments={fmt.value} before the first step")
        self.optimizer = optimizer
        self.fmt = fmt
        self._numel = numel     # element counts: the engine's transient fp32 copies are empty between steps
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self.state: dict[torch.Tensor, dict[str, Any]] = {}     # keyed like torch's: by the tensor
        self.generator: torch.Generator | None = None
        if fmt in (Moments.BF16_SR, Moments.FP8):
            device = next(p.device for g in optimizer.param_groups for p in g["params"])
            # Modulo 2**64, as the stochastic rounding takes its seed: manual_seed refuses ints past 64 bits.
            self.generator = torch.Generator(device=device).manual_seed((seed + 0x5EED) % 2**64)

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step on every tensor with a gradient, in the optimizer's order. No host sync."""
        for group in self.optimizer.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            decoupled = group.get("decoupled_weight_decay", self.decoupled)
            for w in group["params"]:
                if w.grad is None:
                    continue
                if w.dtype != torch.float32 or w.grad.dtype != torch.float32:
                    raise TypeError(f"CompactAdamW steps fp32 tensors with fp32 gradients, got {w.dtype} "
                                    f"with {w.grad.dtype}")
                state = self.state.get(w)
                if state is None:
                    zeros = torch.zeros_like(w, memory_format=torch.preserve_format)
                    state = self.state[w] = {"step": 0, "exp_avg": encode_moment(zeros, self.fmt, None),
                                             "exp_avg_sq": encode_moment(zeros.clone(), self.fmt, None)}
                self._update(w, w.grad, state, lr, beta1, beta2, eps, wd, decoupled)

    def _update(self, w, g, state, lr, beta1, beta2, eps, wd, decoupled) -> None:
        state["step"] += 1
        t = state["step"]
        if wd != 0:
            if decoupled:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        fp8 = self.fmt is Moments.FP8
        m = decode_moment(state["exp_avg"], self.fmt, w)
        v = decode_moment(state["exp_avg_sq"], self.fmt, w)
        if fp8:
            v = v.square()                       # stored as sqrt(v)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1 ** t)
        # torch's own arithmetic (``bias_correction2**0.5``, not math.sqrt): fp32 storage matches it bitwise.
        denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        state["exp_avg"] = encode_moment(m, self.fmt, self.generator)
        state["exp_avg_sq"] = encode_moment(v.sqrt_() if fp8 else v, self.fmt, self.generator)

    # ----------------------------------------------------------------------------- memory, state
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the moments are stored in (for memory accounting)."""
        out = []
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key]
                out += list(value) if isinstance(value, tuple) else [value]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Moments and step counts in the optimizer's order (``None`` for a tensor never stepped), and
        the stochastic-rounding generator: what a bit-exact resume needs."""
        order = [w for g in self.optimizer.param_groups for w in g["params"]]
        return {"format": self.fmt.value,
                "state": [_portable(self.state[w]) if w in self.state else None for w in order],
                "generator": self.generator.get_state() if self.generator is not None else None}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved.get("format") != self.fmt.value:
            raise ValueError(f"the checkpoint holds moments={saved.get('format')}, this engine runs "
                             f"moments={self.fmt.value}: resume with the recipe it was saved under")
        order = [w for g in self.optimizer.param_groups for w in g["params"]]
        states = saved["state"]
        if len(states) != len(order):
            raise ValueError(f"the checkpoint holds moments for {len(states)} tensors, the optimizer steps "
                             f"{len(order)}: was it saved from a different model?")
        self.state = {}
        for w, state in zip(order, states):
            if state is None:
                continue
            m = state["exp_avg"]
            numel = (m[0] if isinstance(m, tuple) else m).numel()
            n = self._numel(w)
            expected = -(-n // FP8_BLOCK) * FP8_BLOCK if self.fmt is Moments.FP8 else n
            if numel != expected:
                raise ValueError(f"saved moments of {numel} elements do not fit a tensor of shape "
                                 f"{tuple(w.shape)}: was it saved from a different model?")
            self.state[w] = {k: (v[0].view(torch.float8_e4m3fn), v[1]) if isinstance(v, tuple) else v
                             for k, v in state.items()}
        if self.generator is not None and saved.get("generator") is not None:
            self.generator.set_state(saved["generator"])


def _portable(state: dict[str, Any]) -> dict[str, Any]:
    # fp8 codes travel as their bytes (uint8): torch 2.13 cannot unpickle a float8 tensor that plain
    # pickle wrote (torch.save can); load_state_dict views them back as e4m3.
    return {k: (v[0].view(torch.uint8), v[1]) if isinstance(v, tuple) else v for k, v in state.items()}
