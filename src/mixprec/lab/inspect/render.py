"""The console view of an InspectReport: memory by role per recipe, the matmul shapes, and the notes.

    console.print(render_memory_table(report))
    console.print(render_matmul_table(report))
    for line in render_notes(report):
        print(line)
"""

from __future__ import annotations

import re

from rich import box
from rich.table import Table

from ..compare.render import format_bytes, short_names
from .report import InspectReport

__all__ = ["render_memory_table", "render_matmul_table", "render_notes"]

_TABLE_ROWS = 15       # matmul shapes shown in the console table; the JSON lists every op
_OP_NAMES = {"convolution": "conv", "convolution_backward": "conv_bwd", "_scaled_mm": "scaled_mm"}


def render_memory_table(report: InspectReport) -> Table:
    """Bytes by role per recipe: predicted, and the measured total beside it where measured."""
    table = Table(title=f"memory of one training step of {report.workload}, batch {report.batch_size}: "
                        "predicted" + (f"; measured: one real step on {report.device}"
                                       if report.measured else " only"),
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("recipe", "weights", "grads", "master", "optim", "activ", "peak", "B/par"):
        table.add_column(name, justify="left" if name == "recipe" else "right", no_wrap=True)
    if report.measured:
        table.add_column("measured", justify="right", no_wrap=True)
    names = short_names((m.recipe, m.label) for m in report.memory)
    for m in report.memory:
        p = m.predicted
        row = [names[m.recipe]] + [format_bytes(v) for v in (p.params, p.grads, p.master, p.optimizer,
                                                               p.activations)]
        # The peak, not the sum of the parts: what the step needs at its worst moment.
        row.append("-" if p.peak is None else format_bytes(p.peak))
        row.append(f"{m.bytes_per_param:.1f}")
        if report.measured:
            row.append("-" if m.measured is None else format_bytes(
                m.measured.peak if m.measured.peak is not None else m.measured.total))
        table.add_row(*row)
    return table


def render_matmul_table(report: InspectReport) -> Table:
    """Matmul shapes of one forward+backward, most FLOPs first, with what misses tensor cores."""
    tc = report.tensor_cores
    groups: dict[tuple, list] = {}
    for op in tc.ops:
        key = (op.op.split(".")[1], op.direction, tuple(d[:2] for d in op.dims))
        entry = groups.setdefault(key, [0, 0, []])
        entry[0] += 1
        entry[1] += op.flops
        if op.module not in entry[2]:
            entry[2].append(op.module)
    table = Table(title=f"matmuls of one forward+backward: {_flops_text(tc.total_flops)}; not a "
                        f"multiple of 8 (fp16/bf16): {tc.misaligned_share(8):.1%} of FLOPs, of 16 (fp8): "
                        f"{tc.misaligned_share(16):.1%}",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("op", "dir", "M N K|Cin Cout", "n", "GFLOP", "share", "x8", "x16", "module"):
        table.add_column(name, justify="right" if name in ("n", "GFLOP", "share") else "left", no_wrap=True)
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    for (op, direction, dims), (count, flops, modules) in rows[:_TABLE_ROWS]:
        flags = [",".join(f"{n}" for n, s in dims if s % k) or "ok" for k in (8, 16)]
        table.add_row(_OP_NAMES.get(op, op), "fwd" if direction == "forward" else "bwd",
                      " ".join(str(s) for _, s in dims), str(count), f"{flops / 1e9:.3g}",
                      f"{flops / tc.total_flops:.1%}" if tc.total_flops else "-", *flags, _pattern(modules))
    return table


def _pattern(modules: list[str]) -> str:
    """``blocks.0.mlp``, ``blocks.1.mlp``, ... -> ``blocks.*.mlp``; unrelated names -> first +N."""
    starred = {re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", m) for m in modules}
    if len(modules) > 1 and len(starred) == 1:
        return starred.pop()
    return modules[0] + (f" +{len(modules) - 1}" if len(modules) > 1 else "")


def _flops_text(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} FLOP"


def render_notes(report: InspectReport) -> list[str]:
    tc = report.tensor_cores
    lines = []
    more = len({(o.op, o.direction, o.dims) for o in tc.ops}) - _TABLE_ROWS
    if more > 0:
        lines.append(f"({more} smaller matmul shapes not shown; --json lists every op)")
    fixes8 = tc.fixes(8)
    extra16 = [f for f in tc.fixes(16) if f.size not in {g.size for g in fixes8}]
    for f in fixes8:
        lines.append(f"fix (fp16/bf16): {f.advice}")
    for f in extra16:
        lines.append(f"fix (fp8 only): {f.advice}")
    if not fixes8 and not extra16:
        lines.append("every matmul dimension is a multiple of 16: fp16, bf16 and fp8 tensor cores all fit")
    names = short_names((m.recipe, m.label) for m in report.memory)
    lines += [f"{names[m.recipe]}: {m.recipe}" for m in report.memory if names[m.recipe] != m.label]
    for prof in report.kernels:
        top = next((k for k in prof.kernels if k.tensor_cores), None)
        unknown = f", {prof.unknown_share:.0%} in matmul kernels of unknown kind" if prof.unknown_share else ""
        lines.append(f"{names.get(prof.recipe, prof.recipe)} on {report.device}: {prof.tensor_core_share:.0%} "
                     f"of GPU kernel time in tensor-core kernels{unknown}"
                     + (f" (longest: {top.name[:60]})" if top else ""))
    for m in report.memory:      # a 16-bit recipe's fp32 activations, by the op that made them
        fp32 = [(op, b) for op, dt, b in m.saved if dt == "float32"]
        total = m.predicted.activations
        if fp32 and total and any(dt in ("float16", "bfloat16") for _, dt, _ in m.saved):
            in_fp32 = sum(b for _, b in fp32)
            lines.append(f"{names[m.recipe]}: {in_fp32 / total:.0%} of saved activations in fp32 "
                         f"({format_bytes(in_fp32)}): "
                         + ", ".join(f"{op} {format_bytes(b)}" for op, b in fp32[:3]))
    if report.measured and any(m.measured is not None and m.measured.peak is None for m in report.memory):
        lines.append(f"measured on {report.device}: the counted parts (this device has no allocator peak); "
                     "on CUDA: the allocator's peak, to hold against the predicted peak")
    lines += [f"note: {n}" for n in report.notes]
    lines.append("weights + grads + master + optim = B/par x parameters; activations: tensors "
                 "autograd saves for the backward; peak: the step's worst moment, with what is never "
                 "saved (logits and their gradient, casts, optimizer temporaries); attention is traced "
                 "on its math path (a fused GPU kernel runs the same matmul shapes)")
    return lines
