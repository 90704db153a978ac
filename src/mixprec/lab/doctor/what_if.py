"""The doctor's what-if: what each low-precision linear format would do to every linear layer of the run.

For each ``nn.Linear`` (and Hugging Face ``Conv1D``) the doctor captures, on the run's last training
step, the layer's input ``x`` (M, K), its weight ``W`` (N, K) and its output gradient ``g`` (M, N, true
units: divided by the loss scale). Then, per format, without touching training:

- **flushed / saturated**: the exact share of ``x``, ``W`` and ``g`` that the format's quantization of
  that operand sends to zero (nonzero values) or clips at the element max (``blockscale.range_counts``
  for the blocked formats; the per-tensor cast of ``fp8/scaling.py``, counted as ``Fp8Linear`` counts);
- **SQNR** (dB, ``10 log10(|ref|^2 / |ref - q|^2)``) of the output ``y = x W^T`` and the weight
  gradient ``grad_W = g^T x`` computed from the format's fake-quantized operands, blocked along each
  GEMM's contraction axis exactly as the recipe's ``Fp8Linear`` blocks them (``fp8/blocked_linear.py``:
  nvfp4's stochastic rounding and random Hadamard transform included), against the same GEMM in bf16
  (``x``, ``W``, ``g`` rounded to bf16, fp32 accumulation: the GEMM a bf16 recipe runs).

- **end-to-end gradient SNR** (``grad_snr.py``, filled in by ``run_doctor`` after the last step): the
  whole model run in the format against fp32, each weight gradient's ``|g| / |g_f - g|`` and sign
  agreement; below ``GRAD_SNR_FLOOR = sqrt(3)`` the format is not tolerated (issue 35).

The formats are the named recipes' (``fp8`` per-tensor current, ``fp8-rowwise``, ``fp8-block``,
``mxfp8``, ``nvfp4``), read from ``RECIPES`` and ``blocked_recipe`` rather than restated here. The
advice per layer is the cheapest format (fewest bits per element, scales included) whose output and
weight-gradient SQNR both reach ``floor_db`` and that saturates nothing; ``bf16`` when none does (the
report's types and the advice: ``what_if_report.py``; this module captures and measures)::

    capture = WhatIfCapture(model)
    with capture.capturing():              # one training step: forward and backward
        loss_fn(model(x), y).backward()
    report = measure_what_if(capture)      # WhatIfReport: per layer and format
    report.advice(report.layers[0])        # e.g. "fp8-block"

Why the recipe's own run: the captured operands are what that run's quantizer would be handed (bf16
activations under the fp8 recipes' bf16 autocast, fp32 weights), and no extra forward or backward is
run; each layer is measured in its gradient hook, when ``g`` arrives, and its copies are dropped. Large
layers keep the first ``max_rows`` rows of ``x`` and ``g`` (whole sequences of the batch,
whole 128-row blocks): the forward is exact for those rows; the weight gradient, and scales taken
over M (per-tensor, rowwise along M, nvfp4's tensor scale), see those rows only. The report says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import zlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ...diagnostics.range_collector import select_modules
from ...formats import Format
from ...fp8.blocked_linear import BlockedRecipe, blocked_recipe, rht_signs, sr_noise
from ...fp8.blockscale import (
    BlockScaling,
    fake_quantize_blocked,
    random_hadamard,
    range_counts,
)
from ...fp8.conv1d import is_hf_conv1d
from ...fp8.linear import ROLES
from ...fp8.scaling import amax_f32, current_scale, quantize_fp8
from ...recipe import RECIPES
# The report's names stay importable from here, where they were defined before (what_if_report.py).
from .what_if_report import (DEFAULT_FLOOR_DB, DEFAULT_MAX_ROWS, FORMATS, GRAD_SNR_FLOOR, ROW_UNIT, FormatWhatIf,
                             LayerWhatIf, WhatIfOptions, WhatIfReport)

__all__ = ["FORMATS", "DEFAULT_FLOOR_DB", "GRAD_SNR_FLOOR", "DEFAULT_MAX_ROWS", "WhatIfOptions", "FormatWhatIf", "LayerWhatIf",
           "WhatIfReport", "WhatIfCapture", "layer_what_if", "measure_what_if", "sqnr_db", "format_bits"]

_BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------ capture
@dataclasses.dataclass
class _Pending:
    """A layer's forward operands, waiting for its output gradient."""

    type: str
    x: torch.Tensor                    # (R, K) as the layer received it (R <= max_rows)
    w: torch.Tensor                    # (N, K) a copy: the optimizer step changes the Parameter in place
    rows_total: int


def _linears(model: nn.Module, modules: Sequence[str] | None) -> dict[str, nn.Module]:
    """The linear layers (``nn.Linear``, ``Fp8Linear``, HF ``Conv1D``) among the doctor's modules."""
    chosen = select_modules(model, modules)
    return {n: m for n, m in chosen.items() if isinstance(m, nn.Linear) or is_hf_conv1d(m)}


def _weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as (out, in): Conv1D and Fp8Conv1D store it (in, out)."""
    if hasattr(module, "_weight_out_in"):
        return module._weight_out_in()
    return module.weight.t() if is_hf_conv1d(module) else module.weight


class WhatIfCapture:
    """Hooks that measure each linear layer's first ``x``, ``W`` and ``g`` of one step, as they come.

    The forward hook keeps a copy of the layer's input (its first ``max_rows`` rows) and weight; when
    the output gradient arrives in backward, the layer is measured (``layer_what_if``) and the copies
    are dropped, so memory holds the operands of the layers whose gradient is still to come, not of all.
    ``inverse_scale``: returns ``1 / loss scale`` as a tensor (or None without loss scaling) then, so
    ``g`` is measured in true units. Only a layer's first call in the block counts (a layer called
    twice, or recomputed under activation checkpointing, is measured once).
    """

    def __init__(self, model: nn.Module, modules: Sequence[str] | None = None, *,
                 max_rows: int = DEFAULT_MAX_ROWS,
                 inverse_scale: Callable[[], torch.Tensor | None] | None = None) -> None:
        WhatIfOptions(max_rows=max_rows)            # the same check and message as the CLI's
        self.max_rows = max_rows
        self._layers = _linears(model, modules)
        self._inverse_scale = inverse_scale or (lambda: None)
        self._pending: dict[str, _Pending] = {}
        self.results: dict[str, LayerWhatIf] = {}
        self.seconds = 0.0                          # spent measuring, in the gradient hooks

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Install the hooks for the block (one forward and backward); the gradients arrive in backward."""
        handles = [m.register_forward_hook(self._hook(name)) for name, m in self._layers.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._pending.clear()                   # layers whose output got no gradient

    def layers(self) -> tuple[LayerWhatIf, ...]:
        """The measured layers in model order (that of ``named_modules``, not of the calls)."""
        return tuple(self.results[n] for n in self._layers if n in self.results)

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if name in self._pending or name in self.results or not args or not isinstance(output, torch.Tensor):
                return
            w = _weight_out_in(module).detach()
            x2d = args[0].detach().reshape(-1, w.shape[1])                   # (M, K)
            rows = _rows_kept(x2d.shape[0], self.max_rows)
            self._pending[name] = _Pending(type(module).__name__, x2d[:rows].clone(), w.clone(), x2d.shape[0])
            if output.requires_grad:
                output.register_hook(lambda g, name=name: self._grad(name, g))
        return hook

    def _grad(self, name: str, g: torch.Tensor) -> None:
        entry = self._pending.pop(name, None)
        if entry is None:
            return
        start = time.perf_counter()
        g2d = g.detach().reshape(-1, entry.w.shape[0])[:entry.x.shape[0]].to(torch.float32)   # (R, N)
        inv = self._inverse_scale()
        if inv is not None:
            g2d = g2d * inv                                                 # 1/S a power of two: exact
        self.results[name] = layer_what_if(entry.x, entry.w, g2d, name=name, layer_type=entry.type,
                                           rows_total=entry.rows_total)     # one host sync
        self.seconds += time.perf_counter() - start


def _rows_kept(rows: int, max_rows: int) -> int:
    """All rows, or the first ``max_rows`` rounded down to whole 128-row blocks."""
    return rows if rows <= max_rows else max_rows // ROW_UNIT * ROW_UNIT


# -------------------------------------------------------------------------------- measurement
def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """``10 log10(|ref|^2 / |ref - test|^2)`` as a 0-d float64 tensor (no host sync).

    inf when ``test == ref`` exactly (both zero included); NaN when either holds inf or NaN.
    """
    # Norms accumulate in float64: sums of millions of squares in fp32 would blur the last 0.01 dB.
    signal = torch.linalg.vector_norm(ref, dtype=torch.float64)
    noise = torch.linalg.vector_norm(ref - test, dtype=torch.float64)
    db = 20 * torch.log10(signal / noise)
    return torch.where(noise == 0, torch.where(torch.isfinite(signal), math.inf, math.nan), db)


def format_bits(fmt: str, in_features: int, out_features: int) -> float:
    """Bits per element of ``fmt``, scales included, averaged over x (blocks along K), W and g (along N).

    A block of ``b`` elements with one scale of ``s`` bits costs ``elem bits + s / b``, ``b`` capped by
    the layer's own dimensions (a 1x128 block of a 64-wide row holds 64); fp32 and power-of-two fp32
    scales take 32 bits, e8m0 and e4m3 ones 8 (nvfp4's one fp32 tensor scale and per-tensor fp8's scale
    are a few bits per tensor: left out). E.g. nvfp4 on a 1024x1024 layer: ``4 + 8/16 = 4.5`` for x and
    g, ``4 + 8/256`` for its 16x16 weight tiles, 4.34 in all.
    """
    how = _blocked(fmt)
    if how is None:
        return sum(f.bits for f in ROLES.values()) / len(ROLES)
    k, n = in_features, out_features
    # (length of the blocked axis, length of the other axis) per role; x and g have 1-row blocks.
    dims = {"input": (k, 1), "weight": (k, n), "grad_output": (n, 1)}
    total = 0.0
    for role, (along, other) in dims.items():
        b: BlockScaling = how.role(role)
        scale_bits = 32 if b.scale in ("fp32", "pow2") else 8
        total += b.elem.bits + scale_bits / (min(b.block or along, along) * min(b.block_rows, other))
    return total / len(dims)


def _blocked(fmt: str) -> BlockedRecipe | None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown what-if format {fmt!r}; valid: {', '.join(FORMATS)}")
    config = RECIPES[fmt].fp8
    assert config is not None, fmt
    return blocked_recipe(config) if config.scaling.blocked else None


def _per_tensor(t: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling as the ``fp8`` recipe casts (``fp8/scaling.py``): (fake-quantized
    fp32 values, int64 [flushed, saturated, total] as ``Fp8Linear`` counts them)."""
    config = RECIPES["fp8"].fp8
    scale = current_scale(amax_f32(t), fmt, margin=config.margin, pow2=config.pow2)
    y = t.to(torch.float32) * scale
    mag = y.abs()
    # |y| <= min_subnormal / 2 rounds to 0 (the tie goes to the even 0). Saturated: finite values that
    # would round above max without the clamp, i.e. beyond the midpoint between max and the next binade
    # step, or on it when max's last mantissa bit is odd (e5m2); current scaling puts amax on max, so
    # this stays 0 unless the scale was capped. A threshold instead of formats.quantize: 2 passes, not 20.
    step = 2.0 ** (fmt.max_exponent - fmt.mantissa_bits)
    tie = fmt.max + step / 2
    odd = int(fmt.max / step) % 2 == 1
    flushed = ((mag <= fmt.min_subnormal / 2) & (y != 0)).sum()
    saturated = ((mag >= tie) if odd else (mag > tie)).sum() - torch.isinf(y).sum()
    counts = torch.stack([flushed, saturated, torch.tensor(y.numel(), device=y.device)])
    return quantize_fp8(t, scale, fmt) / scale, counts


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(_BF16).to(torch.float32)


@torch.no_grad()
def _measure(fmt: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, y_ref: torch.Tensor,
             gw_ref: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(SQNRs [out, grad_W] float64, counts (3 roles, 3) int64) of one format on one layer."""
    how = _blocked(fmt)
    if how is None:                                  # per tensor: one cast of each operand serves all GEMMs
        (x_q, c_x), (w_q, c_w), (g_q, c_g) = (_per_tensor(t, ROLES[r]) for t, r in
                                              ((x, "input"), (w, "weight"), (g, "grad_output")))
        y, gw = x_q @ w_q.t(), g_q.t() @ x_q
    else:
        # Blocks along each GEMM's contraction axis, as BlockedLinearFn: forward over K (axis 1 of x
        # and W); grad_W over M (axis 0 of g and x), after nvfp4's Hadamard transform and with its
        # stochastic rounding of g (the noise and signs a layer of this name gets from the swap).
        y = fake_quantize_blocked(x, how.input, 1) @ fake_quantize_blocked(w, how.weight, 1).t()
        g_m, x_m = g, x
        if how.rht:
            signs = rht_signs(seed).to(x.device)
            g_m, x_m = random_hadamard(g.float(), signs, 0), random_hadamard(x.float(), signs, 0)
        noise = None
        if how.sr:
            seed_t = torch.tensor(seed % 2**32, dtype=torch.int64, device=x.device)
            noise = sr_noise(seed_t, torch.zeros((), dtype=torch.int64, device=x.device), 1, *g.shape)
        gw = fake_quantize_blocked(g_m, how.grad_output, 0, noise=noise).t() @ fake_quantize_blocked(
            x_m, how.input, 0)
        # Counted as Fp8Linear counts them: x and W along K, g along N, rounding to nearest.
        c_x, c_w, c_g = (range_counts(x, how.input, 1), range_counts(w, how.weight, 1),
                         range_counts(g, how.grad_output, 1))
    return torch.stack([sqnr_db(y_ref, y), sqnr_db(gw_ref, gw)]), torch.stack([c_x, c_w, c_g])


@torch.no_grad()
def layer_what_if(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, *, name: str = "", layer_type: str = "Linear",
                  rows_total: int | None = None, formats: Sequence[str] = FORMATS) -> LayerWhatIf:
    """Every format's what-if for one layer's operands: ``x`` (M, K), ``w`` (N, K), ``g`` (M, N).

    One host sync. ``name`` seeds nvfp4's rounding noise and Hadamard signs as the fp8 swap does.
    """
    if x.dim() != 2 or w.dim() != 2 or g.dim() != 2 or x.shape[1] != w.shape[1] or g.shape != (x.shape[0], w.shape[0]):
        raise ValueError(f"layer_what_if needs x (M, K), w (N, K) and g (M, N); got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(g.shape)}")
    x32, w32, g32 = x.to(torch.float32), w.to(torch.float32), g.to(torch.float32)
    xb = _bf16(x32)
    y_ref, gw_ref = xb @ _bf16(w32).t(), _bf16(g32).t() @ xb       # bf16 operands, fp32 accumulation
    seed = zlib.crc32(name.encode())
    sqnrs, counts = zip(*(_measure(f, x32, w32, g32, y_ref, gw_ref, seed) for f in formats))
    sqnrs_l, counts_l = torch.stack(sqnrs).cpu().tolist(), torch.stack(counts).cpu().tolist()   # one sync
    (m, k), n = x.shape, w.shape[0]
    results = tuple(FormatWhatIf(
        format=f, bits=format_bits(f, k, n), sqnr_out_db=s[0], sqnr_grad_w_db=s[1],
        counts={role: tuple(c_role) for role, c_role in zip(ROLES, c)})
        for f, s, c in zip(formats, sqnrs_l, counts_l))
    return LayerWhatIf(name=name, type=layer_type, in_features=k, out_features=n, rows=m,
                       rows_total=m if rows_total is None else rows_total, formats=results)


def measure_what_if(capture: WhatIfCapture, options: WhatIfOptions | None = None, *, step: int = 0
                    ) -> WhatIfReport:
    """The report of what ``capture`` measured: every layer that received a gradient, in model order."""
    options = options or WhatIfOptions(max_rows=capture.max_rows)
    return WhatIfReport(floor_db=float(options.floor_db), max_rows=options.max_rows, step=step,
                        seconds=capture.seconds, layers=capture.layers())
