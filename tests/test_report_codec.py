"""The lab's one report codec: type-driven round trips, the schema-version rule, and old files still reading."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib
from typing import ClassVar

import pytest

from mixprec.lab.codec import Schema, attr, dumps, from_data, read_report, to_data, write_report


class Colour(enum.Enum):
    RED = "a long wording that may change"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    colour: Colour
    weight: float | None = None

    @property
    def heavy(self) -> bool:
        return (self.weight or 0.0) > 1.0


@dataclasses.dataclass(frozen=True)
class Toy:
    SCHEMA: ClassVar[Schema] = Schema("toy", 2, derived={Part: {"heavy": attr("heavy")}},
                                      added=frozenset({"tags"}),
                                      upgrades={1: lambda d: {**d, "parts": [{**p, "colour": "BLUE"}
                                                                             for p in d["parts"]]}})
    count: int
    ratio: float
    parts: tuple[Part, ...]
    pair: tuple[str, int]
    by_size: dict[int, tuple[float, ...]]
    flag: bool
    tags: tuple[str, ...] = ()


def _toy(**changes) -> Toy:
    toy = Toy(count=3, ratio=math.inf,
              parts=(Part("a", Colour.RED, 2.5), Part("b", Colour.BLUE)),
              pair=("x", 7), by_size={8: (0.5, math.nan), 16: ()}, flag=False, tags=("t",))
    return dataclasses.replace(toy, **changes)


def test_round_trip_is_exact_and_the_json_is_strict():
    toy = _toy()
    text = write_report(toy)
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in strict JSON"))
    assert list(data)[:2] == ["schema_version", "kind"] and data["kind"] == "toy" and data["schema_version"] == 2
    assert data["ratio"] == "Infinity" and data["by_size"]["8"] == [0.5, "NaN"]
    # Enums travel by name, not by their (changeable) wording; derived keys are written for readers.
    assert data["parts"][0] == {"name": "a", "colour": "RED", "weight": 2.5, "heavy": True}
    back = read_report(Toy, text)
    assert back.by_size[8][0] == 0.5 and math.isnan(back.by_size[8][1])
    assert dataclasses.replace(back, by_size={}) == dataclasses.replace(toy, by_size={})
    assert isinstance(back.parts, tuple) and isinstance(back.pair, tuple) and list(back.by_size) == [8, 16]


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["parts"][1].pop("name"), "parts[1]: missing ['name']"),
    (lambda d: d["parts"][1].update(size=3), "parts[1]: unknown keys ['size']"),
    (lambda d: d.update(count=True), "count: expected an integer, got True"),
    (lambda d: d.update(count=3.0), "count: expected an integer"),
    (lambda d: d.update(flag=0), "flag: expected true or false"),
    (lambda d: d.update(ratio="lots"), "ratio: expected a number, got 'lots'"),
    (lambda d: d["parts"][0].update(colour="GREEN"), "parts[0].colour: expected one of ['RED', 'BLUE']"),
    (lambda d: d.update(pair=["x"]), "pair: expected a list of 2 items, got 1"),
    (lambda d: d.update(by_size={"eight": []}), "by_size: expected integer keys, got 'eight'"),
    (lambda d: d.update(parts={}), "parts: expected a list, got an object"),
])
def test_a_field_that_does_not_fit_is_named_by_its_path(mutate, words):
    data = json.loads(write_report(_toy()))
    mutate(data)
    with pytest.raises(ValueError, match="toy report does not match schema version 2") as e:
        read_report(Toy, json.dumps(data))
    assert words in str(e.value)


def test_a_field_added_within_the_version_reads_as_its_default_when_absent():
    data = json.loads(write_report(_toy()))
    del data["tags"]
    assert read_report(Toy, json.dumps(data)).tags == ()


def test_an_older_version_it_knows_is_upgraded():
    data = json.loads(write_report(_toy()))
    data["schema_version"] = 1
    for p in data["parts"]:
        del p["colour"]         # version 1 had no colour; its upgrade paints every part blue
    assert [p.colour for p in read_report(Toy, json.dumps(data)).parts] == [Colour.BLUE, Colour.BLUE]


@pytest.mark.parametrize("text, words", [
    ("{", "not a mixprec toy report: invalid JSON"),
    ("[1]", "not a mixprec toy report: the JSON is not an object"),
    ('{"schema_version": 2}', 'not a mixprec toy report (no "kind": "toy")'),
    ('{"schema_version": 1, "kind": "doctor"}', "its kind is 'doctor'"),
    ('{"schema_version": 3, "kind": "toy"}', "schema_version is 3, newer than this mixprec reads (2): upgrade"),
    ('{"schema_version": 0, "kind": "toy"}', "this mixprec reads [1, 2]"),
    ('{"schema_version": "2", "kind": "toy"}', "schema_version is '2', not a version number"),
])
def test_foreign_newer_and_broken_files_are_refused_clearly(text, words):
    with pytest.raises(ValueError) as e:
        read_report(Toy, text)
    assert words in str(e.value)


@dataclasses.dataclass(frozen=True)
class Legacy:
    SCHEMA: ClassVar[Schema] = Schema("legacy", 1, untagged=True)
    n: int


def test_untagged_version_1_files_read_as_their_kind():
    assert read_report(Legacy, '{"n": 1}') == Legacy(1)
    assert read_report(Legacy, '{"schema_version": 1, "n": 2}') == Legacy(2)
    assert json.loads(write_report(Legacy(3))) == {"schema_version": 1, "kind": "legacy", "n": 3}
    with pytest.raises(ValueError, match="its kind is 'toy'"):
        read_report(Legacy, '{"kind": "toy", "n": 1}')


def test_plain_helpers():
    assert dumps({"x": -math.inf, "t": (1, Colour.RED)}, indent=None) == '{"x": "-Infinity", "t": [1, "RED"]}'
    assert from_data(tuple[int, ...], [1, 2]) == (1, 2)
    assert to_data(Part("p", Colour.BLUE)) == {"name": "p", "colour": "BLUE", "weight": None}
    with pytest.raises(TypeError, match="cannot write a set"):
        to_data({1, 2})


# ------------------------------------------------------------- files written by the old writers
DATA = pathlib.Path(__file__).parent / "data"      # made by the CLI before the codec: see data/README.md


def _drop_where_absent(new, old, parts):
    """Remove ``parts`` (e.g. ``["memory[]", "saved"]``) from ``new`` wherever ``old`` lacks it."""
    head, rest = parts[0], parts[1:]
    if head.endswith("[]"):
        for n, o in zip(new.get(head[:-2], []), old.get(head[:-2], [])):
            _drop_where_absent(n, o, rest)
    elif not rest:
        if head not in old:
            new.pop(head, None)
    elif isinstance(new.get(head), dict) and isinstance(old.get(head), dict):    # not null on either side
        _drop_where_absent(new[head], old[head], rest)


def _same_as_written(cls, name: str):
    """Read an old file; writing it again gives the same JSON but for the tags it gained (kind, version)
    and the top-level fields added within version 1 since (``Schema.added``), which read as their default."""
    text = (DATA / name).read_text()
    report = cls.from_json(text)
    old, new = json.loads(text), json.loads(report.to_json())
    assert new["kind"] == cls.SCHEMA.kind and new["schema_version"] == 1
    for tag in ("kind", "schema_version"):
        if tag not in old:
            del new[tag]
    for field in dataclasses.fields(cls):
        if field.name in cls.SCHEMA.added and field.name not in old:
            assert new.pop(field.name) == to_data(field.default)
    for path in cls.SCHEMA.added:     # fields added within the version: written now, absent then
        _drop_where_absent(new, old, path.split("."))
    assert new == old
    assert cls.from_json(report.to_json()) == report
    return report


def test_a_compare_report_from_the_old_writer_reads():
    from mixprec.lab.compare.report import CompareReport
    report = _same_as_written(CompareReport, "compare-v1.json")
    assert [r.label for r in report.runs] == ["fp32", "fp16"] and report.steps == 4
    assert report.runs[1].memory.peak is None and report.runs[0].eval_steps == (2, 4)


@pytest.mark.parametrize("name", ["doctor-v1.json", "doctor-fp8-v1.json"])
def test_a_doctor_report_from_the_old_writer_reads(name):
    from mixprec.fp8.swap_report import Fp8Reason
    from mixprec.lab.doctor.report import DoctorReport
    report = _same_as_written(DoctorReport, name)
    assert report.steps == 2 and [(m.name, m.type) for m in report.modules] == [
        ("0", "Fp8Linear" if "fp8" in name else "Linear"), ("1", "ReLU"), ("2", "Linear")]
    # Linear(64, 256)'s weight and bias, counted on each of the 2 steps; its output for a batch of 64.
    assert report.modules[0].stats["weights"].count == 2 * (256 * 64 + 256)
    assert report.modules[0].stats["activations"].count == 2 * 64 * 256
    if "fp8" in name:
        assert [d.reason for d in report.fp8_swap.layers] == [Fp8Reason.SWAPPED, Fp8Reason.SHAPE]
        # Every fp8 cast of the 2 steps counted: x (64, 64), W (256, 64), the output gradient (64, 256).
        assert [(t.role, t.counted) for t in report.fp8_layers[0].tensors] == [
            ("input", 2 * 64 * 64), ("weight", 2 * 256 * 64), ("grad_output", 2 * 64 * 256)]
    else:
        assert report.fp8_layers == () and report.fp8_swap is None


def test_an_inspect_report_from_the_old_writer_reads():
    from mixprec.lab.inspect.report import InspectReport
    report = _same_as_written(InspectReport, "inspect-v1.json")
    assert [m.label for m in report.memory] == ["fp32", "bf16"] and report.kernels == ()
    # mlp: Linear(64, 256), Linear(256, 10): 64*256 + 256 + 256*10 + 10 weights; fp32 Adam holds 16 B each.
    assert report.memory[0].n_params == 19210
    assert report.memory[0].predicted.params == 4 * 19210 and report.memory[0].predicted.optimizer >= 8 * 19210
    # Batch 64. Forward: 2*64*64*256 + 2*64*256*10 FLOPs. Backward: both weight gradients and the second
    # layer's input gradient (the data needs none): 2*256*64*64 + 2*10*64*256 + 2*64*10*256.
    assert report.tensor_cores.total_flops == 2 * (2 * 64 * 64 * 256) + 3 * (2 * 64 * 256 * 10) == 5_177_344


def test_a_trace_from_the_old_writer_reads():
    from mixprec.lab.trace.report import TraceReport
    report = _same_as_written(TraceReport, "trace-v1.json")      # written untagged by OpTrace.to_json
    assert report.recipe.startswith("params=fp32,compute=bf16")
    first = report.select(module="0", phase="forward", op="addmm")[0]
    assert first.output == "bf16" and first.inputs == ("bf16",) * 3 and first.count == 1


@pytest.mark.parametrize("reader, name, kind", [
    ("mixprec.lab.compare.report:CompareReport", "doctor-v1.json", "doctor"),
    ("mixprec.lab.doctor.report:DoctorReport", "inspect-v1.json", "inspect"),
    ("mixprec.lab.inspect.report:InspectReport", "doctor-fp8-v1.json", "doctor"),
    ("mixprec.lab.trace.report:TraceReport", "inspect-v1.json", "inspect"),
])
def test_each_reader_refuses_another_tools_file_by_its_kind(reader, name, kind):
    import importlib
    module, cls = reader.split(":")
    with pytest.raises(ValueError, match=f"its kind is '{kind}'"):
        getattr(importlib.import_module(module), cls).from_json((DATA / name).read_text())


def test_inspect_kernel_profiles_round_trip_and_render():
    """Kernel profiles are written on CUDA only; their JSON and note are checked here with made-up times."""
    from mixprec.diagnostics.tensor_cores import KernelTime
    from mixprec.lab.inspect.render import render_notes
    from mixprec.lab.inspect.report import InspectReport, RecipeKernels
    report = InspectReport.from_json((DATA / "inspect-v1.json").read_text())
    fp32, bf16 = (m.recipe for m in report.memory)
    kernels = (RecipeKernels(fp32, (KernelTime("gemm_f32", 6, 300.0, False), KernelTime("relu", 6, 100.0, False))),
               RecipeKernels(bf16, (KernelTime("sm90_xmma_gemm_bf16", 6, 150.0, True),
                                    KernelTime("relu", 6, 50.0, False))))
    report = dataclasses.replace(report, kernels=kernels)
    data = json.loads(report.to_json())
    assert [k["tensor_core_share"] for k in data["kernels"]] == [0.0, 0.75]     # 150 of 200 us
    assert InspectReport.from_json(report.to_json()) == report
    notes = render_notes(report)
    assert "bf16 on cpu: 75% of GPU kernel time in tensor-core kernels (longest: sm90_xmma_gemm_bf16)" in notes


def test_an_fp8_swap_report_with_uncovered_weights_round_trips():
    from mixprec.fp8.swap_report import Fp8LayerDecision, Fp8Reason, Fp8SwapReport, Fp8UncoveredWeight
    report = Fp8SwapReport((Fp8LayerDecision("head", 16, 32, Fp8Reason.SWAPPED),), "emulate", "why",
                           (Fp8UncoveredWeight("experts.w", (4, 32, 32), "3-D, ..."),), 6384)
    assert from_data(Fp8SwapReport, json.loads(json.dumps(to_data(report)))) == report
