"""One JSON codec for every lab report, driven by the report dataclasses' type hints.

A report is a frozen dataclass. ``to_data`` turns it into plain JSON data field by field; ``from_data``
reads that data back into the typed dataclass, checking each value against its field's type hint
(nested dataclasses, enums by name, tuples, lists, dicts, ``X | None``), so a reader is never written
by hand and the error names the exact place: ``runs[0].memory.peak: missing``.

The JSON is strict: Python's ``json`` would write NaN and Infinity as bare words that other JSON readers
reject, so non-finite floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``::

    >>> dumps({"loss": float("nan"), "steps": (1, 2)}, indent=None)
    '{"loss": "NaN", "steps": [1, 2]}'
    >>> decode_float("Infinity")
    inf

**The schema-version rule.** Each report declares its ``Schema`` (kind and version) once, as
``SCHEMA`` on its dataclass. ``write_report`` puts ``"schema_version"`` and ``"kind"`` first in the file.
``read_report`` checks the kind (a file of another kind is refused, naming its kind), reads the current
version, upgrades an older version it knows (``Schema.upgrades``), and refuses a newer version, saying
to upgrade mixprec. Within a version a field may be added (``Schema.added``: an older file without it
reads as the field's default); a field that changes meaning or goes away bumps the version. Values
written only for other readers and recomputed from the fields (``Schema.derived``) are ignored on read.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

__all__ = ["Schema", "JsonReport", "attr", "write_report", "read_report", "to_data", "from_data", "dumps",
           "decode_float"]

T = TypeVar("T")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TAGS = ("schema_version", "kind")


@dataclasses.dataclass(frozen=True)
class Schema:
    """What a report's JSON file is: its kind and version, and how older files of it read.

    ``derived``: per dataclass type, extra keys written beside its fields for readers of the file,
    each computed as ``f(report, obj)``; a reader recomputes them, so ``read_report`` skips them.
    ``added``: paths (``"fp8_layers"``, ``"runs[].x"``) of fields added within this version; a file
    from before the addition lacks them and reads as the field's default.
    ``untagged``: version-1 files of this kind were written without ``"kind"`` (and, for trace, without
    ``"schema_version"``); a file without them reads as version 1 of this kind.
    ``upgrades``: ``{old version: f(data) -> data of old version + 1}``, for the older versions this
    code still reads.
    """

    kind: str
    version: int
    derived: Mapping[type, Mapping[str, Callable[[Any, Any], Any]]] = dataclasses.field(default_factory=dict)
    added: frozenset[str] = frozenset()
    untagged: bool = False
    upgrades: Mapping[int, Callable[[dict], dict]] = dataclasses.field(default_factory=dict)


def attr(name: str) -> Callable[[Any, Any], Any]:
    """A ``derived`` entry that writes the object's own property ``name`` (e.g. a computed total)."""
    return lambda _report, obj: getattr(obj, name)


class JsonReport:
    """Base of the report dataclasses: ``to_json`` and ``from_json`` through this codec, by their ``SCHEMA``."""

    SCHEMA: ClassVar[Schema]

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON text, tagged with the report's kind and schema version (schema in its module)."""
        return write_report(self, indent)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        """Read ``to_json``'s text back (or an older version the schema knows); a file of another kind,
        a newer version or a field that does not fit is a ValueError that says which."""
        return read_report(cls, text)


class _Mismatch(ValueError):
    """A value that does not fit its field's type; ``path`` says where."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or 'the report'}: {problem}")


# --------------------------------------------------------------------------------------- writing
def write_report(report: Any, indent: int | None = 2) -> str:
    """``report`` (a dataclass with a ``SCHEMA``) as strict JSON text, tagged with kind and version."""
    schema: Schema = type(report).SCHEMA
    data = {"schema_version": schema.version, "kind": schema.kind, **to_data(report, schema, report)}
    return dumps(data, indent=indent)


def to_data(value: Any, schema: Schema | None = None, report: Any = None) -> Any:
    """Plain JSON data for ``value``: dataclasses as objects (plus ``schema``'s derived keys), enums by
    name, tuples as lists, dict keys as strings, non-finite floats as strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: to_data(getattr(value, f.name), schema, report) for f in dataclasses.fields(value)}
        derived = schema.derived.get(type(value), {}) if schema is not None else {}
        for key, compute in derived.items():
            out[key] = to_data(compute(report, value), schema, report)
        return out
    if isinstance(value, enum.Enum):
        return value.name          # by name ("SHAPE"): stable when an enum's wording changes
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): to_data(v, schema, report) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_data(v, schema, report) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot write a {type(value).__name__} to a report; give the report a dataclass, "
                    "number, string, enum, tuple, list or dict")


def dumps(data: Any, indent: int | None = 2) -> str:
    """``data`` as strict JSON text (non-finite floats as strings)."""
    return json.dumps(to_data(data), indent=indent, allow_nan=False)


# --------------------------------------------------------------------------------------- reading
def read_report(cls: type[T], text: str) -> T:
    """Read a file written by ``write_report`` (or an older version ``cls.SCHEMA`` knows) as a ``cls``.

    A file that is not JSON, of another kind, or of a newer version is a ValueError saying which and
    what to do; a field that does not fit is a ValueError naming its path.
    """
    schema: Schema = cls.SCHEMA
    what = f"mixprec {schema.kind} report"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a {what}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a {what}: the JSON is not an object")
    kind = data.get("kind")
    if kind is None and not schema.untagged:
        raise ValueError(f"not a {what} (no \"kind\": \"{schema.kind}\")")
    if kind is not None and kind != schema.kind:
        raise ValueError(f"not a {what}: its kind is {kind!r}; read it as a {kind} report")
    version = data.get("schema_version", 1 if schema.untagged else None)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"not a {what}: schema_version is {version!r}, not a version number")
    if version > schema.version:
        raise ValueError(f"{schema.kind} report schema_version is {version}, newer than this mixprec "
                         f"reads ({schema.version}): upgrade mixprec, or read it with the mixprec that "
                         "wrote it")
    known = [v for v in range(1, schema.version) if v in schema.upgrades]
    if version < schema.version and version not in known:
        raise ValueError(f"{schema.kind} report schema_version is {version}; this mixprec reads "
                         f"{sorted(known + [schema.version])}: read it with the mixprec that wrote it")
    body = {k: v for k, v in data.items() if k not in _TAGS}
    for old in range(version, schema.version):
        body = schema.upgrades[old](body)
    try:
        return from_data(cls, body, schema)
    except _Mismatch as e:
        raise ValueError(f"{schema.kind} report does not match schema version {schema.version}: {e}") from None


def from_data(hint: Any, data: Any, schema: Schema | None = None, path: str = "") -> Any:
    """``data`` (plain JSON) read as the type ``hint``; ``_Mismatch`` (a ValueError) names the path."""
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, data, schema, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if data is None and len(options) < len(args):
            return None
        if len(options) != 1:
            raise TypeError(f"{path}: the codec reads X | None, not {hint}")
        return from_data(options[0], data, schema, path)
    if origin is tuple or origin is list:
        if not isinstance(data, list):
            raise _Mismatch(path, f"expected a list, got {_json_name(data)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(data) != len(args):
                raise _Mismatch(path, f"expected a list of {len(args)} items, got {len(data)}")
            return tuple(from_data(a, v, schema, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
        items = [from_data(args[0], v, schema, f"{path}[{i}]") for i, v in enumerate(data)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(data, dict):
            raise _Mismatch(path, f"expected an object, got {_json_name(data)}")
        key_type, value_type = args
        return {_key(key_type, k, path): from_data(value_type, v, schema, f"{path}.{k}") for k, v in data.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if not isinstance(data, str) or data not in hint.__members__:
            raise _Mismatch(path, f"expected one of {list(hint.__members__)}, got {data!r}")
        return hint[data]
    return _scalar(hint, data, path)


def _scalar(hint: Any, data: Any, path: str) -> Any:
    if hint is Any:
        return data
    if hint is float:
        try:
            return decode_float(data)
        except ValueError as e:
            raise _Mismatch(path, str(e)) from None
    if hint is bool and isinstance(data, bool) or hint is str and isinstance(data, str):
        return data
    if hint is int and isinstance(data, int) and not isinstance(data, bool):
        return data
    if hint in (bool, int, str):
        return _fail(path, {bool: "true or false", int: "an integer", str: "a string"}[hint], data)
    raise TypeError(f"{path}: the codec cannot read the type {hint!r}")


def _fail(path: str, expected: str, data: Any) -> Any:
    raise _Mismatch(path, f"expected {expected}, got {data!r}")


def _key(key_type: Any, key: str, path: str) -> Any:
    """JSON object keys are strings; an ``int``-keyed dict reads them back as integers."""
    if key_type is int:
        try:
            return int(key)
        except ValueError:
            raise _Mismatch(path, f"expected integer keys, got {key!r}") from None
    return key


def _dataclass(cls: type, data: Any, schema: Schema | None, path: str) -> Any:
    if not isinstance(data, dict):
        raise _Mismatch(path, f"expected an object ({cls.__name__}), got {_json_name(data)}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    hints = _hints(cls)
    derived = set(schema.derived.get(cls, {})) if schema is not None else set()
    unknown = sorted(data.keys() - {f.name for f in fields} - derived)
    if unknown:
        raise _Mismatch(path, f"unknown keys {unknown}")
    values, missing = {}, []
    for f in fields:
        where = f"{path}.{f.name}" if path else f.name
        if f.name in data:
            values[f.name] = from_data(hints[f.name], data[f.name], schema, where)
        elif schema is None or _shape(where) not in schema.added:
            missing.append(f.name)
    if missing:
        raise _Mismatch(path, f"missing {missing}")
    return cls(**values)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _shape(path: str) -> str:
    """``runs[3].memory`` -> ``runs[].memory``: the path without list indices."""
    return re.sub(r"\[\d+\]", "[]", path)


def _json_name(data: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(data), "a number")


def decode_float(value: Any) -> float:
    """A number read back from ``dumps``; ValueError for anything that is not one."""
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)
