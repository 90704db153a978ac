"""InspectReport: what ``mixprec inspect`` found, as a dataclass whose JSON comes from the lab's codec.

JSON schema, version 1 (strict JSON: non-finite floats as "NaN"/"Infinity" strings, like compare's)::

    schema_version     int     1
    kind               str     "inspect"
    workload           str     the workload's name
    device             str     where measured figures come from ("cpu", "cuda:0")
    batch_size         int     the batch traced and measured
    torch_version, mixprec_version   str
    measured           bool    whether one real step per recipe was measured
    notes              [str]   caveats, e.g. why nothing was measured
    memory             list    one object per recipe:
      recipe, label    str     full recipe string; its name
      n_params         int     trainable parameter elements
      bytes_per_param  float   (weights + grads + master + optimizer) / n_params, predicted
      predicted        object  params, grads, master, optimizer, activations, peak (the step's worst
                               moment, transients included): int bytes
      measured         object|null  the same, from one real step (peak: CUDA allocator peak or null)
      saved            list    predicted saved activations split by op (the op that made the tensor,
                               autograd's name) and dtype: [op str, dtype str, bytes int]; largest first
      saved_measured   list|null  the same, from one real step
    matmul_flops       int     FLOPs of every matmul/convolution of one forward+backward
    misaligned_share   object  {"8": fraction, "16": fraction}: FLOPs share in ops with a dim that is
                               not a multiple of 8 (fp16/bf16) or 16 (fp8)
    fixes              object  {"8": [fix], "16": [fix]}; fix: size int, role "weight"|"activation",
                               modules [str], pad_to int, flops int, advice str
    matmuls            list    every op: op str, module str, direction "forward"|"backward",
                               shapes [[int]], dims [[name str, size int, role str]], flops int
    kernels            list    CUDA only (else empty): per recipe, 3 profiled real steps:
      recipe           str
      tensor_core_share float  fraction of GPU kernel time in tensor-core kernels (by what each kernel is)
      unknown_share    float  fraction in matmul kernels whose kind cannot be told (tensor_core_share is a
                               lower bound by this much)
      kernels          list    name str, calls int, time_us float, tensor_cores bool or null (unknown);
                               longest first

The fields mirror the file; ``bytes_per_param``, ``matmul_flops``, ``misaligned_share``, ``fixes`` and each
recipe's ``tensor_core_share`` are written for readers and recomputed from the fields when read back, so
``InspectReport.from_json(report.to_json()) == report``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...diagnostics.memory_report import MemoryReport
from ...diagnostics.tensor_cores import Fix, KernelProfile, KernelTime, MatmulOp, TensorCoreReport
from ..codec import JsonReport, Schema, attr

__all__ = ["InspectReport", "RecipeKernels"]

MULTIPLES = (8, 16)     # tensor-core size rules: 8 for fp16/bf16 matmuls, 16 for fp8


@dataclasses.dataclass(frozen=True)
class RecipeKernels:
    """The GPU kernels of profiled real steps under one recipe (CUDA only), longest first."""

    recipe: str
    kernels: tuple[KernelTime, ...]

    @property
    def tensor_core_share(self) -> float:
        """Fraction of GPU kernel time spent in tensor-core kernels (judged by what each kernel is)."""
        return KernelProfile(self.kernels).tensor_core_share

    @property
    def unknown_share(self) -> float:
        """Fraction in matmul kernels whose kind cannot be told: the share above is a lower bound by this."""
        return KernelProfile(self.kernels).unknown_share


@dataclasses.dataclass(frozen=True)
class InspectReport(JsonReport):
    """Memory per recipe and every matmul of one traced training step of a workload."""

    SCHEMA: ClassVar[Schema]

    workload: str
    device: str
    batch_size: int
    torch_version: str
    mixprec_version: str
    measured: bool
    notes: tuple[str, ...]
    memory: tuple[MemoryReport, ...]
    matmuls: tuple[MatmulOp, ...]
    kernels: tuple[RecipeKernels, ...]      # one per recipe that ran on CUDA; empty elsewhere

    @property
    def tensor_cores(self) -> TensorCoreReport:
        """The matmuls with their FLOPs shares and fixes (the traced batch leads every input)."""
        return TensorCoreReport(self.matmuls, self.batch_size)

    @property
    def misaligned_share(self) -> dict[int, float]:
        return {k: self.tensor_cores.misaligned_share(k) for k in MULTIPLES}

    @property
    def fixes(self) -> dict[int, list[Fix]]:
        return {k: self.tensor_cores.fixes(k) for k in MULTIPLES}



# Added within version 1 (older files read them as empty): the saved-activation split by op and dtype.
InspectReport.SCHEMA = Schema("inspect", 1, added=frozenset({"memory[].saved", "memory[].saved_measured"}),
                              derived={
    MemoryReport: {"bytes_per_param": attr("bytes_per_param")},
    RecipeKernels: {"tensor_core_share": attr("tensor_core_share"), "unknown_share": attr("unknown_share")},
    InspectReport: {"matmul_flops": lambda report, _: report.tensor_cores.total_flops,
                    "misaligned_share": attr("misaligned_share"), "fixes": attr("fixes")}})
