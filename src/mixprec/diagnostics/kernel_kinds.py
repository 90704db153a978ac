"""What a CUDA kernel is, read from its name: a tensor-core matmul, a matmul on the CUDA cores, or no matmul.

Vendors encode the math instruction in the kernel name. The name part that says *how* the kernel
multiplies decides, never the library it comes from (an ``xmma`` or ``cutlass`` kernel can be either):

- tensor cores: ``hmma`` (fp16/bf16 MMA), ``imma`` (int8), ``gmma``/``wgmma``/``qgmma`` (Hopper's warpgroup
  MMA; ``q`` for fp8), ``tensorop``/``wmma`` (CUTLASS), MMA tile shapes such as ``h884``, ``s1688``,
  ``h16816`` (Volta, Turing and Ampere MMA tiles), and cuBLASLt's ``nvjet`` kernels whose type letters name a 16-bit or
  fp8 operand (``hsh``: fp16 in, fp32 accumulate, fp16 out; ``tst``: bf16; ``qqtst``: e4m3 x e4m3;
  ``qrtst``: e4m3 x e5m2).
- CUDA cores (SIMT): ``ffma`` (one fused multiply-add per thread), ``simt``, ``sgemm``/``dgemm``/``gemv``,
  and an ``xmma`` kernel typed ``f32f32_f32f32_f32``: fp32 math with no ``tf32`` in the type string;
  Hopper has no fp32 tensor-core instruction, so such a kernel is FFMA. H100 run of 2026-11-22:
  ``sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma_...`` had been counted as tensor-core work.
- no matmul: elementwise, reduction and copy kernels (``at::native::...``, Inductor's ``triton_poi``/
  ``triton_red``/``triton_per``, even when the fused op list reads ``_scaled_mm``), memcpy/memset.

Where the name names its operand types, they are checked against the floating dtypes of the op that
launched the kernel (the profiler's ``input_dtypes``); a disagreement, or a matmul kernel whose name says
nothing about its math (``nvjet_sm90_sss``: TF32 or not?), is ``unknown``: the share of GPU time on
tensor cores is then a lower bound, never a guess.

    >>> classify_kernel("nvjet_sm90_hsh_24x64_64x16_4x2_h_bz_bias_TNN").tensor_cores
    True
    >>> classify_kernel("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_ffma").tensor_cores
    False
    >>> classify_kernel("nvjet_sm90_sss_128x64_64x8_1x1_v_bz_NNT").tensor_cores is None
    True
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

__all__ = ["KernelClass", "classify_kernel", "dtype_family"]


@dataclasses.dataclass(frozen=True)
class KernelClass:
    """``tensor_cores``: True (MMA instructions), False (CUDA cores, or no matmul at all), None (unknown)."""

    tensor_cores: bool | None
    reason: str


# Operand families: what a tensor-core instruction is chosen by.
_FAMILY_OF_DTYPE = {"float": "fp32", "float32": "fp32", "c10::half": "16bit", "half": "16bit",
                    "float16": "16bit", "c10::bfloat16": "16bit", "bfloat16": "16bit",
                    "double": "fp64", "float64": "fp64"}
_NVJET_LETTERS = {"h": "16bit", "t": "16bit", "s": "fp32", "d": "fp64", "q": "fp8", "r": "fp8", "i": "int8"}
_XMMA_TYPES = {"f16": "16bit", "bf16": "16bit", "f32": "fp32", "tf32": "fp32", "e4m3": "fp8",
               "e5m2": "fp8", "s8": "int8", "i8": "int8", "f64": "fp64"}

_NOT_A_MATMUL = re.compile(r"^(memcpy|memset)|^triton_(poi|red|per)_|splitkreduce|"
                           r"(elementwise|reduce|multi_tensor_apply|copy|fill|softmax|norm)_?kernel",
                           re.IGNORECASE)
_MATMUL = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|mma|tensorop|conv|fprop|dgrad|wgrad|flash|fmha|"
                     r"attention|triton_tem|cudnn", re.IGNORECASE)
_SIMT = re.compile(r"ffma|simt|(^|[_:])[sd]gemm|gemv|gemmsn|gemmk1|implicit_convolve_sgemm", re.IGNORECASE)
_MMA = re.compile(r"hmma|imma|wgmma|qgmma|gmma|tensorop|wmma|(^|_)[hsi](884|1688|16816|8816|16832|161616)"
                  r"|_mma_", re.IGNORECASE)
_NVJET_TYPES = re.compile(r"nvjet_(?:sm\d+_)?([a-z]{3,5})_", re.IGNORECASE)
_XMMA_SIGNATURE = re.compile(r"xmma_\w*?_((?:[a-z]+\d+){2})_((?:[a-z]+\d+){2})_([a-z]+\d+)", re.IGNORECASE)


def dtype_family(dtype: str) -> str | None:
    """The operand family of a dtype as the profiler spells it (``c10::Half`` -> ``16bit``); None: not floating."""
    d = dtype.strip().lower().replace("torch.", "")
    if "float8" in d:
        return "fp8"
    return _FAMILY_OF_DTYPE.get(d)


def _xmma_types(signature: str) -> list[str]:
    return re.findall(r"[a-z]+\d+", signature.lower())


def _named_families(name: str) -> tuple[set[str], bool | None]:
    """Operand families the name states, and whether its math is on tensor cores (None: not said)."""
    if m := _NVJET_TYPES.search(name):
        letters = m.group(1).lower()
        operands = letters[:2] if len(letters) == 5 else letters[:1]   # qqtst: A, B; hsh: A = B
        if any(c not in _NVJET_LETTERS for c in letters):
            return set(), None
        families = {_NVJET_LETTERS[c] for c in operands}
        # 16-bit and fp8 nvjet kernels are MMA kernels; an all-fp32 one may be TF32 or not.
        return families, (True if families & {"16bit", "fp8", "int8"} else None)
    if m := _XMMA_SIGNATURE.search(name):
        operands, math = _xmma_types(m.group(1)), _xmma_types(m.group(2))
        families = {_XMMA_TYPES.get(t, "?") for t in operands}
        if "tf32" in math or families & {"16bit", "fp8", "int8"}:
            return families, True
        if families == {"fp32"}:
            return families, False      # fp32 math without tf32: Hopper and Ampere do it with FFMA
        return families, None
    return set(), None


def classify_kernel(name: str, op_dtypes: Iterable[str] = ()) -> KernelClass:
    """Whether the CUDA kernel ``name`` ran on tensor cores; ``op_dtypes``: the launching op's input dtypes.

    See the module docstring for the rules. Never guesses: a matmul kernel whose math cannot be read
    from its name, or whose named operand types contradict ``op_dtypes``, is ``tensor_cores=None``.
    """
    if _NOT_A_MATMUL.search(name) or not _MATMUL.search(name):
        return KernelClass(False, "not a matmul or convolution kernel")
    families, named_tc = _named_families(name)
    op_families = {f for f in (dtype_family(d) for d in op_dtypes) if f is not None}
    if families and op_families and not families & op_families:
        return KernelClass(None, f"the name says {'/'.join(sorted(families))} operands, the launching op "
                                 f"had {'/'.join(sorted(op_families))}")
    if _SIMT.search(name) or named_tc is False:
        return KernelClass(False, "a matmul on the CUDA cores (FFMA/SIMT)")
    if named_tc or _MMA.search(name):
        return KernelClass(True, "MMA instructions (tensor cores)")
    low = op_families & {"16bit", "fp8"}
    if re.search(r"flash_(fwd|bwd)", name, re.IGNORECASE):
        return KernelClass(True, "flash attention: MMA tiles, fp16/bf16 only")
    if re.search(r"fmha|triton_tem", name, re.IGNORECASE) and (
            low or re.search(r"_(b?f16)_", name, re.IGNORECASE)):
        # tl.dot and CUTLASS attention on 16-bit or fp8 operands compile to MMA instructions (sm80+).
        return KernelClass(True, "16-bit operands through an MMA-tiled kernel")
    return KernelClass(None, "a matmul kernel whose name does not say how it multiplies")
