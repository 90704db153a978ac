"""The inspect experiment: where a workload's memory goes per recipe, and which matmuls miss tensor cores.

Nothing trains. The tensor-core table comes from one forward and backward traced on the meta device
(shapes only); the memory table from the engine run on fake tensors (``memory_report``), both without
allocating the model, so ``mixprec inspect --benchmark gpt2`` takes seconds on a laptop. For built-in
workloads (and for every workload on a GPU) one real step per recipe is also *measured* on a copy of the
model, and the table shows both::

    plan = plan_inspect("gpt", ["fp32", "bf16"], device="cpu")
    report = run_inspect(plan)
    report.memory[1].predicted.activations, report.misaligned_share_8

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
      predicted        object  params, grads, master, optimizer, activations (int bytes), peak (null)
      measured         object|null  the same, from one real step (peak: CUDA allocator peak or null)
      saved            list    predicted saved activations split by op (the op that made the tensor,
                               autograd's name) and dtype: op str, dtype str, bytes int; largest first
    matmul_flops       int     FLOPs of every matmul/convolution of one forward+backward
    misaligned_share   object  {"8": fraction, "16": fraction}: FLOPs share in ops with a dim that is
                               not a multiple of 8 (fp16/bf16) or 16 (fp8)
    fixes              object  {"8": [fix], "16": [fix]}; fix: size int, role "weight"|"activation",
                               modules [str], pad_to int, flops int, advice str
    matmuls            list    every op: op str, module str, direction "forward"|"backward",
                               shapes [[int]], dims [[name str, size int, role str]], flops int
    kernels            list    CUDA only (else empty): per recipe, 3 profiled real steps:
      recipe           str
      tensor_core_share float  fraction of GPU kernel time in tensor-core kernels (by kernel name)
      kernels          list    name str, calls int, time_us float, tensor_cores bool; longest first
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence

import torch
from rich import box
from rich.table import Table

from .. import __version__
from ..devices import resolve_device, supports
from ..diagnostics.memory_report import MemoryReport, memory_report
from ..diagnostics.tensor_cores import KernelProfile, TensorCoreReport, profile_kernels, trace_matmuls
from ..engine import MixedPrecision
from ..recipe import Recipe
from .compare import DEFAULT_RECIPES, unique_recipes
from .report import format_bytes, short_names
from .strict_json import dumps
from .workloads import Workload, get_workload

__all__ = ["InspectPlan", "InspectReport", "plan_inspect", "run_inspect", "render_memory_table",
           "render_matmul_table", "render_notes", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
_TABLE_ROWS = 15       # matmul shapes shown in the console table; the JSON lists every op
_OP_NAMES = {"convolution": "conv", "convolution_backward": "conv_bwd", "_scaled_mm": "scaled_mm"}


@dataclasses.dataclass(frozen=True)
class InspectPlan:
    workload: Workload
    recipes: tuple[Recipe, ...]
    device: torch.device
    batch_size: int
    measure: bool


@dataclasses.dataclass(frozen=True)
class InspectReport:
    workload: str
    device: str
    batch_size: int
    measured: bool
    memory: tuple[MemoryReport, ...]
    tensor_cores: TensorCoreReport
    notes: tuple[str, ...] = ()
    kernels: tuple[tuple[str, KernelProfile], ...] = ()    # (recipe, profile) per recipe; CUDA only

    @property
    def misaligned_share_8(self) -> float:
        return self.tensor_cores.misaligned_share(8)

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON, schema in the module docstring."""
        tc = self.tensor_cores
        data = {
            "schema_version": SCHEMA_VERSION, "kind": "inspect", "workload": self.workload,
            "device": self.device, "batch_size": self.batch_size, "torch_version": torch.__version__,
            "mixprec_version": __version__, "measured": self.measured, "notes": list(self.notes),
            "memory": [{"recipe": m.recipe, "label": m.label, "n_params": m.n_params,
                        "bytes_per_param": m.bytes_per_param,
                        "predicted": dataclasses.asdict(m.predicted),
                        "measured": None if m.measured is None else dataclasses.asdict(m.measured),
                        "saved": [{"op": op, "dtype": dt, "bytes": b} for op, dt, b in m.saved]}
                       for m in self.memory],
            "matmul_flops": tc.total_flops,
            "misaligned_share": {str(k): tc.misaligned_share(k) for k in (8, 16)},
            "fixes": {str(k): [dataclasses.asdict(f) for f in tc.fixes(k)] for k in (8, 16)},
            "matmuls": [dataclasses.asdict(op) for op in tc.ops],
            "kernels": [{"recipe": recipe, "tensor_core_share": prof.tensor_core_share,
                         "kernels": [dataclasses.asdict(k) for k in prof.kernels]}
                        for recipe, prof in self.kernels],
        }
        return dumps(data, indent=indent)


def plan_inspect(workload: str | Workload = "mlp", recipes: Sequence[str | Recipe] = DEFAULT_RECIPES, *,
                 device: str | torch.device | None = "auto", batch_size: int | None = None) -> InspectPlan:
    """Check the inputs of an inspect run; ValueError/TypeError name the fix.

    Measuring needs real memory: it happens for built-in workloads, and for benchmarks on a GPU.
    """
    if not isinstance(workload, Workload):
        workload = get_workload(workload)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    if batch_size is None:
        batch_size = workload.batch_size
    elif isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
    parsed = unique_recipes(recipes, "inspect")
    measure = not workload.synthetic or device.type == "cuda"
    return InspectPlan(workload, tuple(parsed.values()), device, batch_size, measure)


def run_inspect(plan: InspectPlan) -> InspectReport:
    """Trace, predict and (per the plan) measure; returns the typed report."""
    w, notes = plan.workload, []
    model, real = _build(w, meta=not plan.measure)
    if real:
        model = model.to(plan.device)
    if not plan.measure:
        notes.append(f"{w.name} is a benchmark sized for GPUs: on {plan.device} its memory is predicted "
                     "only (fake tensors), nothing is allocated or measured")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"workload {w.name!r} builds a model without parameters: nothing to inspect")
    data = w.load_data()
    # Copies, as the trainer's minibatch gather makes: a slice would keep the whole data set's storage
    # alive in the tensors autograd saves, and the meter would count all of it.
    x, y = data.x_train[:plan.batch_size].clone(), data.y_train[:plan.batch_size].clone()
    if len(x) < plan.batch_size:
        raise ValueError(f"--batch-size {plan.batch_size} is more than the {len(x)} training rows of "
                         f"{w.name}; choose at most {len(x)}")
    if real:
        x, y = x.to(plan.device), y.to(plan.device)
    tensor_cores = trace_matmuls(model, (x, y), loss_fn=w.loss_fn)
    memory = []
    for recipe in plan.recipes:
        support = supports(recipe, plan.device)
        if plan.measure and not support.ok:
            notes.append(f"{recipe.label}: {support.reason}; predicted only")
        # measure=True trains one step on a deep copy: the same model serves every recipe.
        memory.append(memory_report(model, recipe, (x, y), optimizer=w.make_optimizer, loss_fn=w.loss_fn,
                                    measure=plan.measure and support.ok))
    kernels = []
    if plan.device.type == "cuda":
        kernels = [(str(r), _profile(w, model, r, x, y)) for r in plan.recipes if supports(r, plan.device).ok]
    return InspectReport(w.name, str(plan.device), plan.batch_size, plan.measure, tuple(memory),
                         tensor_cores, tuple(notes), tuple(kernels))


def _profile(w: Workload, model: torch.nn.Module, recipe: Recipe, x: torch.Tensor, y: torch.Tensor
             ) -> KernelProfile:
    """Profile real training steps of a copy of ``model`` under ``recipe`` (CUDA)."""
    twin = copy.deepcopy(model)
    mp = MixedPrecision(twin, w.make_optimizer(twin.parameters()), recipe)

    def step() -> None:
        with mp.autocast():
            loss = w.loss_fn(twin(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    return profile_kernels(step)


def _build(w: Workload, meta: bool):
    """The workload's model on the meta device (nothing allocated); a real one where that fails."""
    if meta:
        try:
            with torch.device("meta"):
                return w.build_model(), False
        except Exception:     # a user's builder that reads values: build it for real instead
            pass
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return w.build_model(), True


# ------------------------------------------------------------------------------------- tables
def render_memory_table(report: InspectReport) -> Table:
    """Bytes by role per recipe: predicted, and the measured total beside it where measured."""
    table = Table(title=f"memory of one training step of {report.workload}, batch {report.batch_size}: "
                        "predicted" + (f"; measured: one real step on {report.device}"
                                       if report.measured else " only"),
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("recipe", "weights", "grads", "master", "optim", "activ", "total", "B/par"):
        table.add_column(name, justify="left" if name == "recipe" else "right", no_wrap=True)
    if report.measured:
        table.add_column("measured", justify="right", no_wrap=True)
    names = short_names((m.recipe, m.label) for m in report.memory)
    for m in report.memory:
        p = m.predicted
        row = [names[m.recipe]] + [format_bytes(v) for v in (p.params, p.grads, p.master, p.optimizer,
                                                               p.activations, p.total)]
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
    for recipe, prof in report.kernels:
        top = next((k for k in prof.kernels if k.tensor_cores), None)
        lines.append(f"{names.get(recipe, recipe)} on {report.device}: {prof.tensor_core_share:.0%} of GPU "
                     f"kernel time in tensor-core kernels" + (f" (longest: {top.name[:60]})" if top else ""))
    for m in report.memory:      # a 16-bit recipe's fp32 activations, by the op that made them
        fp32 = [(op, b) for op, dt, b in m.saved if dt == "float32"]
        total = m.predicted.activations
        if fp32 and total and any(dt in ("float16", "bfloat16") for _, dt, _ in m.saved):
            in_fp32 = sum(b for _, b in fp32)
            lines.append(f"{names[m.recipe]}: {in_fp32 / total:.0%} of saved activations in fp32 "
                         f"({format_bytes(in_fp32)}): "
                         + ", ".join(f"{op} {format_bytes(b)}" for op, b in fp32[:3]))
    lines += [f"note: {n}" for n in report.notes]
    lines.append("weights + grads + master + optim = B/par x parameters; activations: tensors "
                 "autograd saves for the backward; attention is traced on its math path (a fused GPU "
                 "kernel runs the same matmul shapes)")
    return lines
