"""A speed model: what a linear layer's training step costs on a target GPU in each format, predicted.

Nothing here is timed. Each GEMM and each cast pass is costed on a roofline from the target's spec
sheet: ``time = max(FLOPs / dense tensor-core peak of its format, bytes moved / HBM bandwidth)``. A
linear layer ``y = x W^T`` with ``x`` (M, K), ``W`` (N, K) and output gradient ``g`` (M, N) runs three
GEMMs a step (forward ``x W^T``, input gradient ``g W``, weight gradient ``g^T x``: ``2 M N K`` FLOPs
each) and, in a low-precision format, quantizes its operands first::

    cost = linear_cost(get_target("h100"), LinearShape("blocks.0.mlp.c_fc", m=8192, n=3072, k=768), "rowwise")
    cost.seconds, cost.gemm_s, cost.cast_s

What the casts move, per operand (bf16 activations and gradients, fp32 weights read for their cast):

- bf16 (autocast): the weight is read in fp32 and written in bf16 once a step; ``x`` and ``g`` are bf16 already.
- every fp8/fp4 format: each operand is read once and written in its format **twice** (two layouts: the
  weight gradient contracts over M, the others over K or N, so the quantized copies differ; per-tensor
  fp8 writes a transposed copy); scales add their bytes (4 B per 128 for rowwise/block, 1 B per 32 for
  mxfp8, 1 B per 16 for nvfp4).
- ``current`` and ``nvfp4`` read each operand once more for its tensor amax; ``nvfp4`` also runs a
  random Hadamard transform over ``x`` and ``g`` for the weight gradient (a bf16 read and write each).

The whole step: ``step_profile`` runs one bf16 training step under a dispatch mode and costs every aten op
on the same roofline (FLOPs from torch's own formulas, bytes from its tensors), so the plan's step is
that bf16 step with each linear's bf16 cost replaced by its cost in the format chosen for it. The ratio
is a prediction for the named target, whatever machine computes it.

How much to trust it: the peaks are dense spec-sheet numbers, which large GEMMs reach to within ~70-80%
and small ones do not approach; the blocked formats' efficiencies on Hopper (``EFFICIENCY``) are
assumptions; fused cast kernels may save passes this model counts. It ranks formats and layers well
(a GEMM four times larger costs about four times more) and predicts absolute ratios to about 10-20%.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["Target", "TARGETS", "get_target", "LinearShape", "LinearCost", "linear_cost", "FORMAT_WORDS",
           "StepProfile", "step_profile", "op_seconds"]

# Formats the model knows: bf16 (the baseline) and the fp8 recipe's scalings (recipe/fp8.py's words).
FORMAT_WORDS = ("bf16", "current", "delayed", "rowwise", "block", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU from its spec sheet: dense tensor-core TFLOP/s per compute format, HBM bandwidth, and the
    fp8/fp4 scalings it has kernels for."""

    name: str
    label: str
    tflops: dict[str, float]          # "bf16", "fp8", "fp4" -> dense TFLOP/s (no sparsity)
    hbm_tb_s: float                   # HBM bandwidth, TB/s
    kernels: tuple[str, ...]          # scalings with a tensor-core kernel (FORMAT_WORDS minus bf16)
    source: str                       # where the numbers come from

    def peak(self, fmt: str) -> float:
        """FLOP/s of the tensor cores ``fmt`` runs on (bf16, fp8 or fp4)."""
        return self.tflops[_COMPUTE[fmt]] * 1e12


_HOPPER = ("current", "delayed", "rowwise", "block")
TARGETS: dict[str, Target] = {
    "h100": Target("h100", "NVIDIA H100 SXM5 80 GB", {"bf16": 989.4, "fp8": 1978.9}, 3.35, _HOPPER,
                   "NVIDIA H100 Tensor Core GPU datasheet (SXM5): dense BF16 989.4, FP8 1978.9 TFLOPS; HBM3 3.35 TB/s"),
    "h200": Target("h200", "NVIDIA H200 SXM 141 GB", {"bf16": 989.4, "fp8": 1978.9}, 4.8, _HOPPER,
                   "NVIDIA H200 datasheet (SXM): dense BF16 989 TFLOPS, FP8 1979 TFLOPS; HBM3e 4.8 TB/s"),
    "b200": Target("b200", "NVIDIA B200 180 GB", {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0}, 8.0,
                   _HOPPER + ("mxfp8", "nvfp4"),
                   "NVIDIA DGX B200 datasheet, per GPU: dense BF16 2.25, FP8 4.5, FP4 9 PFLOPS; HBM3e 8 TB/s"),
}

_COMPUTE = {"bf16": "bf16", "current": "fp8", "delayed": "fp8", "rowwise": "fp8", "block": "fp8",
            "mxfp8": "fp8", "nvfp4": "fp4"}
# Element bits and scale bytes per element of each stored format.
_BITS = {"bf16": 16, "current": 8, "delayed": 8, "rowwise": 8, "block": 8, "mxfp8": 8, "nvfp4": 4}
_SCALE_BYTES = {"bf16": 0.0, "current": 0.0, "delayed": 0.0, "rowwise": 4 / 128, "block": 4 / 128,
                "mxfp8": 1 / 32, "nvfp4": 1 / 16}
_AMAX_PASS = {"current": 1, "nvfp4": 1}          # extra reads of each operand for a tensor amax
# Share of the tensor-core peak each format's GEMM reaches relative to per-tensor fp8, per target
# family: assumptions (no spec sheet gives them). Hopper applies row/block scales in software in the
# GEMM's main loop; Blackwell's MX/NV block scales are hardware.
EFFICIENCY = {("hopper", "rowwise"): 0.9, ("hopper", "block"): 0.8}


def get_target(name: str) -> Target:
    """The target called ``name`` (h100, h200, b200); an unknown one lists the known ones."""
    if not isinstance(name, str) or name.strip().lower() not in TARGETS:
        close = difflib.get_close_matches(str(name).lower(), list(TARGETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown target {name!r}{hint}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name.strip().lower()]


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """A linear layer's GEMM sizes in one step: ``m`` rows (tokens), ``n`` out and ``k`` in features.
    ``groups`` > 1: a grouped GEMM (a mixture of experts' projection): ``m`` routed rows over ``groups``
    weights of (n, k) each, all read, cast and (their gradients) written every step."""

    name: str
    m: int
    n: int
    k: int
    groups: int = 1

    @property
    def flops(self) -> int:
        """FLOPs of its three GEMMs (forward, input gradient, weight gradient)."""
        return 3 * 2 * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """One linear layer's predicted step cost in one format on one target."""

    format: str
    gemm_s: float
    cast_s: float
    bytes: float            # bytes moved by its GEMMs and casts

    @property
    def seconds(self) -> float:
        return self.gemm_s + self.cast_s


def linear_cost(target: Target, shape: LinearShape, fmt: str) -> LinearCost:
    """The three GEMMs and the casts of ``shape`` in ``fmt`` on ``target`` (ValueError: no kernel there)."""
    if fmt not in FORMAT_WORDS:
        raise ValueError(f"unknown format {fmt!r}; the speed model knows {', '.join(FORMAT_WORDS)}")
    if fmt != "bf16" and fmt not in target.kernels:
        raise ValueError(f"{target.name} has no tensor-core kernel for {fmt} (it has: "
                         f"{', '.join(target.kernels)}); that format would run emulated there")
    m, n, k, nk = shape.m, shape.n, shape.k, shape.n * shape.k * shape.groups      # nk: every weight element
    per = _BITS[fmt] / 8 + _SCALE_BYTES[fmt]                # bytes per stored element, scales included
    family = "blackwell" if "fp4" in target.tflops else "hopper"
    peak = target.peak(fmt) * EFFICIENCY.get((family, fmt), 1.0)
    bw = target.hbm_tb_s * 1e12
    gemm_s, gemm_bytes = 0.0, 0.0
    # (operand a elements, operand b elements, output elements, output bytes per element)
    for a, b, out, out_b in ((m * k, nk, m * n, 2), (m * n, nk, m * k, 2), (m * n, m * k, nk, 4)):
        moved = (a + b) * per + out * out_b
        gemm_s += max(2 * m * n * k / peak, moved / bw)
        gemm_bytes += moved
    x, w, g = m * k, nk, m * n
    if fmt == "bf16":
        cast_bytes = w * (4 + 2)                            # fp32 weight -> bf16, once a step
    else:
        reads = x * 2 + w * 4 + g * 2                       # bf16 activations/gradients, fp32 weights
        cast_bytes = reads * (1 + _AMAX_PASS.get(fmt, 0)) + 2 * (x + w + g) * per
        if fmt == "nvfp4":
            cast_bytes += (x + g) * 2 * 2                  # the Hadamard transform: read and write bf16
    return LinearCost(fmt, gemm_s, cast_bytes / bw, gemm_bytes + cast_bytes)


def op_seconds(target: Target, flops: float, nbytes: float) -> float:
    """One op on the roofline at bf16 peak: the larger of its compute and its memory time."""
    return max(flops / target.peak("bf16"), nbytes / (target.hbm_tb_s * 1e12))


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Every aten op of one step, costed: total FLOPs, bytes, and roofline seconds on the target."""

    ops: int
    flops: float
    bytes: float
    seconds: float


class _Costing(TorchDispatchMode):
    def __init__(self, target: Target) -> None:
        super().__init__()
        self.target, self.ops, self.flops, self.bytes, self.seconds = target, 0, 0.0, 0.0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_view(func):
            return out                                      # a view: no kernel, no traffic
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        flops = 0.0
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            try:
                flops = float(formula(*args, **kwargs, out_val=out))
            except Exception:                               # a formula that does not fit this call: bytes only
                flops = 0.0
        nbytes = float(sum(t.numel() * t.element_size() for t in ins + outs))
        self.ops += 1
        self.flops += flops
        self.bytes += nbytes
        self.seconds += op_seconds(self.target, flops, nbytes)
        return out


def _is_view(func) -> bool:
    """An op whose output aliases its input without writing it (view, reshape of a contiguous tensor)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


def step_profile(step: Callable[[], None], target: Target) -> StepProfile:
    """Run ``step`` (one forward, backward and optimizer step) once, costing each aten op on ``target``'s
    roofline at bf16 peak, as the bf16 recipe would run it there."""
    mode = _Costing(target)
    with mode:
        step()
    return StepProfile(mode.ops, mode.flops, mode.bytes, mode.seconds)
