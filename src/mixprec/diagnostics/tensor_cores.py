"""Which matmuls and convolutions can run on tensor cores, and the padding that fixes those that cannot.

Tensor cores multiply tiles: cuBLAS and cuDNN pick them for fp16/bf16 only when every GEMM dimension
(M, N, K; a convolution's input and output channels) is a multiple of 8 elements, 16 for fp8 and 4 for
tf32 (16 bytes either way). Otherwise they fall back to slower kernels or run partly empty tiles
(NVIDIA's rule for fp16 tensor cores since Volta). ``trace_matmuls`` runs one forward and backward on the ``meta`` device (shapes only, no
memory: GPT-2's 124M weights are never allocated) under a dispatch mode that records every matmul-like
aten op with its shapes, its FLOPs (torch.utils.flop_counter's formulas: 2*M*N*K for a GEMM) and the
module it came from (backward ops too: ``ModuleScope``)::

    report = trace_matmuls(model, (x, y), loss_fn=F.cross_entropy)
    report.misaligned_share(8)          # fraction of the step's matmul FLOPs that miss the rule for fp16
    for fix in report.fixes(8): print(fix)

Attention through ``scaled_dot_product_attention`` is traced on its math path (meta has no fused
kernel), so its two batched matmuls and their gradients appear as ``bmm``; on a GPU a fused kernel runs
them with the same shapes. ``profile_kernels`` (CUDA only) times a real step with torch.profiler and says
which kernels ran on tensor cores, from what each kernel is (``kernel_kinds``: its name's math
instruction, checked against the dtypes of the op that launched it; "unknown" where that does not tell).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from .kernel_kinds import classify_kernel
from ..guards.module_scope import ModuleScope
from .shadow import meta_copy, meta_like

__all__ = ["MatmulOp", "Fix", "TensorCoreReport", "trace_matmuls", "alignment", "padded_size",
           "KernelTime", "KernelProfile", "profile_kernels", "is_tensor_core_kernel"]

_aten = torch.ops.aten
_GEMMS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm}
_CONVS = {_aten.convolution, _aten.convolution_backward}
# A weight dimension is padded to a multiple of 64 (whole warps of tiles: nanoGPT's 50257 -> 50304)
# when that costs at most this fraction more, else to the next multiple the format needs.
_WIDE_PAD = 64
_WIDE_PAD_COST = 0.01
# Profiler spans that are not kernels: optimizer.step annotations and profiler step markers.
_ANNOTATION = re.compile(r"^(Optimizer\.\w+#|ProfilerStep#)")


def alignment(dtype: torch.dtype | str) -> int | None:
    """Elements a tensor-core GEMM dimension must be a multiple of: 8 (fp16/bf16), 16 (fp8), 4 (tf32).

    ``None`` for fp32 without TF32: no tensor cores at all.
    """
    name = str(dtype).replace("torch.", "")
    if name in ("float16", "bfloat16", "fp16", "bf16"):
        return 8
    if name.startswith("float8") or name.startswith("fp8"):
        return 16
    if name == "tf32":
        return 4
    return None


def padded_size(dim: int, multiple: int) -> int:
    """The size to pad a weight dimension to: a multiple of 64 if that costs <= 1% more, else of ``multiple``.

    >>> padded_size(50257, 8), padded_size(100, 8), padded_size(10, 16)
    (50304, 104, 16)
    """
    wide = -(-dim // _WIDE_PAD) * _WIDE_PAD
    if wide % multiple == 0 and (wide - dim) <= _WIDE_PAD_COST * dim:
        return wide
    return -(-dim // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """One matmul-like op of the traced step.

    ``dims`` are the dimensions tensor cores need aligned, each ``(name, size, role)``: a GEMM's M, N
    and K; a convolution's input and output channels per group. ``role`` is ``"weight"`` when the size
    is one of the module's parameter dimensions (fixed by padding the layer) and ``"activation"``
    otherwise (rows: batch x positions, sequence length; fixed by the batch or sequence size).
    """

    op: str                              # aten overload, e.g. "aten.addmm.default"
    module: str                          # qualified module name (ModuleScope's labels)
    direction: str                       # "forward" or "backward"
    shapes: tuple[tuple[int, ...], ...]  # the shapes of its tensor inputs
    dims: tuple[tuple[str, int, str], ...]
    flops: int

    def misaligned(self, multiple: int) -> tuple[tuple[str, int, str], ...]:
        """The dims that are not a multiple of ``multiple``."""
        return tuple(d for d in self.dims if d[1] % multiple)


@dataclasses.dataclass(frozen=True)
class Fix:
    """One padding that would put ops back on tensor cores."""

    size: int              # the offending size
    role: str              # "weight" or "activation"
    modules: tuple[str, ...]
    pad_to: int            # the suggested size
    flops: int             # FLOPs of the ops this size makes miss the rule
    advice: str

    def __str__(self) -> str:
        return self.advice


@dataclasses.dataclass(frozen=True)
class TensorCoreReport:
    """Every matmul/convolution of one traced forward+backward, in execution order."""

    ops: tuple[MatmulOp, ...]
    batch_size: int | None             # leading size of the first input, for the batch advice

    @property
    def total_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def misaligned_flops(self, multiple: int) -> int:
        return sum(op.flops for op in self.ops if op.misaligned(multiple))

    def misaligned_share(self, multiple: int) -> float:
        """Fraction of the matmul FLOPs in ops with a dimension that is not a multiple of ``multiple``."""
        total = self.total_flops
        return self.misaligned_flops(multiple) / total if total else 0.0

    def fixes(self, multiple: int) -> list[Fix]:
        """One fix per offending size, most FLOPs first."""
        modules: dict[tuple[int, str], list[str]] = {}
        flops: dict[tuple[int, str], int] = {}
        for op in self.ops:
            for key in {(size, role) for _, size, role in op.misaligned(multiple)}:
                names = modules.setdefault(key, [])
                if op.module not in names:
                    names.append(op.module)
                flops[key] = flops.get(key, 0) + op.flops   # an op counts once per offending size
        fixes = [self._fix(size, role, tuple(modules[(size, role)]), flops[(size, role)], multiple)
                 for size, role in modules]
        return sorted(fixes, key=lambda f: -f.flops)

    def _fix(self, size: int, role: str, modules: tuple[str, ...], flops: int, multiple: int) -> Fix:
        where = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
        share = flops / self.total_flops if self.total_flops else 0.0
        if role == "weight":
            to = padded_size(size, multiple)
            advice = (f"pad {size} -> {to} in {where} with zeros (features, channels or vocabulary rows; "
                      f"padded vocabulary ids are never targets): {share:.1%} of matmul FLOPs")
        else:
            batch = self.batch_size
            to = -(-size // multiple) * multiple
            hint = (f"; e.g. batch size {batch} -> {-(-batch // multiple) * multiple}"
                    if batch and batch % multiple else "")
            advice = (f"rows/sequence {size} in {where} is not a multiple of {multiple}: choose batch "
                      f"size and sequence length so it is{hint}: {share:.1%} of matmul FLOPs")
        return Fix(size, role, modules, to, flops, advice)


class _MatmulRecorder(TorchDispatchMode):
    def __init__(self, scope: ModuleScope, params_of: Callable[[str], set[int]]) -> None:
        super().__init__()
        self.scope, self.params_of, self.ops = scope, params_of, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _GEMMS or packet in _CONVS:
            node = torch._C._current_autograd_node()
            module = self.scope.owner(node) if node is not None else self.scope.current()
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            dims = _gemm_dims(packet, args) if packet in _GEMMS else _conv_dims(packet, args)
            weights = self.params_of(module)
            dims = tuple((n, s, "weight" if s in weights else "activation") for n, s in dims)
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.ops.append(MatmulOp(str(func), module, "backward" if node is not None else "forward",
                                     shapes, dims, flops))
        return out


def _gemm_dims(packet, args) -> tuple[tuple[str, int], ...]:
    a, b = (args[1], args[2]) if packet in (_aten.addmm, _aten.baddbmm) else (args[0], args[1])
    return (("M", a.shape[-2]), ("N", b.shape[-1]), ("K", a.shape[-1]))


def _conv_dims(packet, args) -> tuple[tuple[str, int], ...]:
    # convolution(input, weight, ...); convolution_backward(grad_out, input, weight, ...). The weight is
    # (C_out, C_in / groups, *kernel) (transposed: (C_in, C_out / groups, ...)); groups is last but one
    # of convolution's arguments and convolution_backward's ninth.
    weight = args[1] if packet is _aten.convolution else args[2]
    transposed = bool(args[6] if packet is _aten.convolution else args[7])
    groups = int(args[8] if packet is _aten.convolution else args[9])
    c0, c1 = weight.shape[0], weight.shape[1]
    c_out, c_in = (c1, c0 // groups) if transposed else (c0 // groups, c1)
    return (("C_in", c_in), ("C_out", c_out))


def trace_matmuls(model: nn.Module, batch: Any, *, loss_fn: Callable[..., torch.Tensor] | None = None
                  ) -> TensorCoreReport:
    """Trace one forward and backward of ``model`` on ``batch`` on the meta device; list its matmuls.

    ``batch`` is the model's input, or ``(inputs, targets)`` with ``loss_fn(outputs, targets)``;
    without ``loss_fn`` the backward starts from the sum of the outputs. ``model`` may live on any
    device, meta included: a memory-free copy is traced and the model is left as it was. Raises
    ValueError when the model cannot run on meta tensors (an op without a meta kernel, data-dependent
    control flow), saying so.
    """
    shadow = meta_copy(model)
    if not any(True for _ in shadow.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameters: there is no matmul to inspect")
    inputs, targets = (batch if loss_fn is not None else (batch, None))
    inputs, targets = meta_like((inputs, targets))
    weight_sizes = {name or "(model)": {s for p in m.parameters() for s in p.shape}
                    for name, m in shadow.named_modules()}
    scope = ModuleScope(shadow)
    recorder = _MatmulRecorder(scope, lambda name: weight_sizes.get(name, set()))
    try:
        with recorder:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            out = shadow(*args)
            loss = loss_fn(out, targets) if loss_fn is not None else _sum_floating(out)
            if loss.requires_grad:
                loss.backward()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot trace {type(model).__name__} on the meta device (shapes only): {first}. "
                         "Tensor-core and memory predictions need a model whose ops have meta kernels "
                         "and whose control flow does not read tensor values") from None
    finally:
        scope.remove()
    first = next((t for t in _leaves(inputs)), None)
    return TensorCoreReport(tuple(recorder.ops), int(first.shape[0]) if first is not None and first.dim() else None)


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _sum_floating(out: Any) -> torch.Tensor:
    floats = [t for t in _leaves(out) if t.is_floating_point()]
    if not floats:
        raise ValueError("the model's output holds no floating tensor to take a gradient of; pass loss_fn")
    return sum(t.float().sum() for t in floats)


# ------------------------------------------------------------------------------- GPU profiling
def is_tensor_core_kernel(name: str, op_dtypes: Iterable[str] = ()) -> bool:
    """Whether a CUDA kernel's name says it runs on tensor cores (``kernel_kinds.classify_kernel``;
    False where it says CUDA cores, no matmul, or cannot tell)."""
    return classify_kernel(name, op_dtypes).tensor_cores is True


@dataclasses.dataclass(frozen=True)
class KernelTime:
    name: str
    calls: int
    time_us: float
    tensor_cores: bool | None        # None: a matmul kernel whose math its name does not tell


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """GPU kernels of profiled steps, longest first, and the share of GPU time on tensor cores."""

    kernels: tuple[KernelTime, ...]

    @property
    def total_us(self) -> float:
        return sum(k.time_us for k in self.kernels)

    @property
    def tensor_core_share(self) -> float:
        total = self.total_us
        return sum(k.time_us for k in self.kernels if k.tensor_cores) / total if total else 0.0

    @property
    def unknown_share(self) -> float:
        """Share of GPU time in matmul kernels that could not be classified: the tensor-core share is
        a lower bound, this much below the truth at most."""
        total = self.total_us
        return sum(k.time_us for k in self.kernels if k.tensor_cores is None) / total if total else 0.0


def profile_kernels(step: Callable[[], Any], *, steps: int = 3, warmup: int = 2) -> KernelProfile:
    """Run ``step()`` ``warmup`` times, then ``steps`` times under torch.profiler; classify its kernels.

    CUDA only (ValueError otherwise). Synchronises the device before and after the profiled steps.
    """
    if not torch.cuda.is_available():
        raise ValueError("profiling kernels needs a CUDA GPU; none is visible (the meta-device trace, "
                         "trace_matmuls, works anywhere)")
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return _kernel_profile(prof.events())


def _kernel_profile(events: Iterable[Any]) -> KernelProfile:
    """Kernel times from profiler events, each kernel classified by its name and its op's dtypes."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    # The dtypes of the ops that launched each kernel (record_shapes=True fills input_dtypes; torch
    # builds without the field give none, and classification then rests on the name alone).
    op_dtypes: dict[str, set[str]] = {}
    for e in events:
        if e.device_type == cpu and e.kernels:
            dtypes = {d for d in (getattr(e, "input_dtypes", None) or []) if isinstance(d, str)}
            for k in e.kernels:
                op_dtypes.setdefault(k.name, set()).update(dtypes)
    # Kernels appear as device-side events, and as the .kernels of the CPU ops that launched them;
    # take the first form, or the second where a torch build lists no device events. User
    # annotations (``Optimizer.step#AdamW.step``) are spans over other kernels, not kernels: skip them.
    launched = [(e.name, e.device_time_total) for e in events
                if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
                and not _ANNOTATION.match(e.name)]
    if not launched:
        launched = [(k.name, k.duration) for e in events for k in e.kernels if not _ANNOTATION.match(k.name)]
    kernels: dict[str, list[float]] = {}
    for name, duration_us in launched:
        entry = kernels.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += duration_us
    rows = [KernelTime(name, int(c), t, classify_kernel(name, op_dtypes.get(name, ())).tensor_cores)
            for name, (c, t) in kernels.items()]
    return KernelProfile(tuple(sorted(rows, key=lambda k: -k.time_us)))
