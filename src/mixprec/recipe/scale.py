"""The loss-scale part of a recipe: ``LossScaleConfig`` and its words in the recipe grammar.

``scale=none``, ``scale=static:V`` and ``scale=dynamic(init=,growth=,backoff=,growth_interval=,
hysteresis=,floor=,ceiling=)``; ``scale=per-layer(...)`` takes the same options (the dynamic S, times one
factor per layer: ``loss_scale/per_layer.py``). ``str()`` prints the shortest exact text back (powers of two as 2**k)::

    >>> str(LossScaleConfig.parse("dynamic(hysteresis=2)"))
    'dynamic(hysteresis=2)'
    >>> LossScaleConfig.parse("static:2**10").init
    1024.0
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import re
import struct

__all__ = ["LossScaleConfig", "LossScaleKind"]


class LossScaleKind(str, enum.Enum):
    """How the loss is scaled. A ``str`` enum: ``LossScaleKind.NONE == "none"``, so either spelling works."""

    NONE = "none"
    STATIC = "static"
    DYNAMIC = "dynamic"
    PER_LAYER = "per-layer"     # the dynamic S times a power-of-two factor per layer (loss_scale/per_layer.py)


_STATIC_MAX = 2.0**24
# The smallest loss scale accepted (init, floor, ceiling). S multiplies every gradient before it is
# stored in fp16, whose smallest subnormal is 2**-24: with S < 2**-24 even a gradient of 1 in true units
# (far above any ordinary one) lands below it and flushes to 0 (or, above 2**-25, rounds to 2**-24 with no
# mantissa left), so training stalls without a word.
# Scales below 1 are legitimate (they shrink gradients whose backward overflows fp16), but never that far.
# It also keeps every scale far above fp32's subnormals (< 2**-126), where the stored S would be 0 or lossy.
_SCALE_MIN = 2.0**-24
# growth_interval and hysteresis are counted on the device in int32 tensors (loss_scale/scales.py's
# clean_steps and hysteresis_left): a larger value overflows them.
_INT32_MAX = 2**31 - 1
_FLOAT_FIELDS = ("init", "growth", "backoff", "floor", "ceiling")
_INT_FIELDS = ("growth_interval", "hysteresis")


def _f32(x: float) -> float:
    """``x`` as the fp32 the device tensor will hold (round to nearest; inf past fp32's max)."""
    try:
        x = float(x)
    except OverflowError:   # an int past float64 (10**400): past fp32 too
        return math.inf
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """How the loss is scaled before backward.

    ``kind`` (a ``LossScaleKind``) is ``"none"``, ``"static"`` (multiply by ``init`` always), ``"dynamic"`` (start at
    ``init``; on an overflow skip the step and, after ``hysteresis`` overflows without a growth in
    between, multiply by ``backoff``; after ``growth_interval`` clean steps in a row multiply by
    ``growth``; never leave ``[floor, ceiling]``) or ``"per-layer"`` (that dynamic S, and inside each layer
    a power-of-two factor of its own on top: ``mixprec.loss_scale.per_layer``).

    Values are checked as the device will hold them: a scale (``init``, ``floor``, ``ceiling``) must be
    finite in fp32 and at least 2**-24 (below it fp16 flushes every gradient under 1 to zero);
    ``growth_interval`` and ``hysteresis`` are ints in ``[1, 2**31-1]`` (int32 counters)::

        >>> LossScaleConfig(init=2.0**-30)
        Traceback (most recent call last):
        ...
        ValueError: loss scale init=9.313225746154785e-10 is below 2**-24 ...
    """

    kind: LossScaleKind = LossScaleKind.DYNAMIC
    init: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    floor: float = 1.0
    ceiling: float = 2.0**24

    def __post_init__(self) -> None:
        if self.kind not in tuple(LossScaleKind):
            raise ValueError(f"unknown loss scale {self.kind!r}; valid values: "
                             f"{', '.join(k.value for k in LossScaleKind)}")
        self._check_types()
        # The scale lives in an fp32 device tensor (loss_scale/scales.py): check each value as fp32 holds it,
        # not as the float64 it arrived in (1e-50 is a fine float64 and 0 in fp32).
        init_f32 = _f32(self.init)
        if not (math.isfinite(init_f32) and init_f32 >= _SCALE_MIN):
            raise ValueError(_scale_error("init", self.init, init_f32))
        if self.kind in ("dynamic", "per-layer"):
            # growth and backoff multiply the fp32 scale: in fp32 they must stay > 1 and in (0, 1)
            # (1 + 1e-10 rounds to 1.0, and the scale would never grow).
            if not (math.isfinite(self.growth) and _f32(self.growth) > 1.0):
                raise ValueError(f"loss scale growth must be > 1 and finite (as fp32 holds it), got "
                                 f"{self.growth!r}; use e.g. growth=2")
            if not 0.0 < _f32(self.backoff) < 1.0:
                raise ValueError(f"loss scale backoff must be in (0, 1) (as fp32 holds it), got "
                                 f"{self.backoff!r}; use e.g. backoff=0.5")
            for name in _INT_FIELDS:
                value = getattr(self, name)
                if not 1 <= value <= _INT32_MAX:
                    raise ValueError(f"loss scale {name} must be >= 1 and at most 2**31-1 = {_INT32_MAX} "
                                     f"(it is counted in an int32 device tensor), got {value}")
            for name in ("floor", "ceiling"):
                value_f32 = _f32(getattr(self, name))
                if not (math.isfinite(value_f32) and value_f32 >= _SCALE_MIN):
                    raise ValueError(_scale_error(name, getattr(self, name), value_f32))
            if not (0.0 < self.floor <= self.init <= self.ceiling < math.inf):
                raise ValueError("loss scale needs 0 < floor <= init <= ceiling < inf, got "
                                 f"floor={self.floor}, init={self.init}, ceiling={self.ceiling}")

    def _check_types(self) -> None:
        # bool is an int to Python, but init=True or hysteresis=True is a mistake, not a number.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"LossScaleConfig.{name} must be a number (e.g. {name}="
                                f"{_num(getattr(LossScaleConfig, name))}), got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"LossScaleConfig.{name} must be an int (a count of steps, e.g. {name}="
                                f"{getattr(LossScaleConfig, name)}), got {value!r}"
                                + (f"; write {name}={int(value)} if that is what you mean"
                                   if isinstance(value, float) and value.is_integer() else ""))

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "static":
            return f"static:{_num(self.init)}"
        default = LossScaleConfig()
        changed = [f"{f.name}={_num(getattr(self, f.name))}" for f in dataclasses.fields(self)
                   if f.name != "kind" and getattr(self, f.name) != getattr(default, f.name)]
        return LossScaleKind(self.kind).value + (f"({','.join(changed)})" if changed else "")

    @classmethod
    def parse(cls, text: str) -> LossScaleConfig:
        """``none`` | ``static:1024`` | ``dynamic`` | ``dynamic(hysteresis=2,init=1024)`` | ``per-layer(...)``."""
        if not isinstance(text, str):
            raise TypeError(f"a loss scale is spelled as a string (none, static:1024, dynamic(...)), "
                            f"got {type(text).__name__}")
        text = text.strip()
        if text == "none":
            return cls(kind=LossScaleKind.NONE)
        if text.startswith("static"):
            _, sep, value = text.partition(":")
            if not sep:
                raise ValueError("a static loss scale needs its value, e.g. scale=static:1024")
            init = _parse_float(value, "static loss scale")
            if init > _STATIC_MAX:
                # S multiplies every gradient: fp16 holds at most 65504, so with S above 2**24 any
                # gradient above ~4e-3 becomes inf and every step is skipped. 2**24 is the dynamic ceiling.
                raise ValueError(f"static loss scale {value.strip()} is above 2**24: fp16 gradients "
                                 "overflow to inf and every step is skipped; use at most 2**24, or "
                                 "scale=dynamic to let the scale find its level")
            return cls(kind=LossScaleKind.STATIC, init=init)
        m = re.fullmatch(r"(dynamic|per-layer)(?:\((.*)\))?", text)
        if not m:
            raise ValueError(f"unknown loss scale {text!r}; valid forms: none, static:VALUE, dynamic, "
                             "dynamic(init=..,growth=..,backoff=..,growth_interval=..,hysteresis=..,"
                             "floor=..,ceiling=..), per-layer, per-layer(the same options)")
        kwargs: dict[str, float | int] = {}
        names = {f.name: f for f in dataclasses.fields(cls) if f.name != "kind"}
        for item in filter(None, (m.group(2) or "").split(",")):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"unknown dynamic loss scale option {item!r}; valid keys: "
                                 f"{', '.join(names)}")
            if key in kwargs:
                raise ValueError(f"dynamic loss scale option {key!r} given twice in {text!r}; give it once")
            kwargs[key] = _parse_int(value, key) if key in _INT_FIELDS else _parse_float(value, key)
        return cls(kind=LossScaleKind(m.group(1)), **kwargs)


def _num(x: float) -> str:
    """Shortest exact text for a float: powers of two as 2**k, integers plainly."""
    # frexp, not log2: log2 rounds, and log2(2**-24 * (1 + 2**-52)) is exactly -24.0, which would print
    # a neighbour of 2**-24 as 2**-24 and break the round trip. x = m * 2**e is a power of two iff m == 0.5.
    mantissa, exponent = math.frexp(x) if math.isfinite(x) else (0.0, 0)
    if x > 0 and mantissa == 0.5 and abs(exponent - 1) >= 12:
        return f"2**{exponent - 1}"
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _parse_float(text: str, what: str) -> float:
    text = text.strip()
    try:
        if text.startswith("2**"):
            return 2.0 ** float(text[3:])
        return float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number (e.g. 1024 or 2**16), got {text!r}") from None
    except OverflowError:   # 2**5000: past float64 itself
        raise ValueError(f"{what} {text} is past float64's range; a loss scale for fp16 needs at most "
                         "2**24") from None


def _parse_int(text: str, what: str) -> int:
    """A count (growth_interval, hysteresis): a whole number, written 2000, 2e3 or 2**11; never 1.5."""
    value = _parse_float(text, what)
    if not value.is_integer():   # also nan and inf
        raise ValueError(f"{what} must be a whole number of steps, got {text.strip()!r}; "
                         + (f"e.g. {what}={math.floor(value)} or {what}={math.ceil(value)}" if math.isfinite(value)
                            else f"e.g. {what}=2"))
    return int(value)


def _scale_error(name: str, value: float, value_f32: float) -> str:
    """The message for a scale (init, floor, ceiling) that fp32 cannot hold as a usable loss scale."""
    if not value > 0:   # 0, negative, nan
        return (f"loss scale {name} must be a positive number, got {value!r}; use e.g. {name}=2**16, "
                "or scale=dynamic to let the scale find its level")
    if math.isinf(value_f32):
        return (f"loss scale {name}={value!r} is inf in fp32 (the scale's device dtype; its max is about "
                f"3.4e38): every scaled gradient would overflow; use at most 2**24")
    held = ("0" if value_f32 == 0 else f"{value_f32!r}, a subnormal" if value_f32 < 2.0**-126
            else repr(value_f32))
    return (f"loss scale {name}={value!r} is below 2**-24 (in fp32, the scale's device dtype: {held}): "
            "multiplied by it, every fp16 gradient below 1 in true units falls below fp16's smallest subnormal "
            "and flushes to zero (or keeps no mantissa bit), so training stalls without a word; "
            f"use {name} >= 2**-24, or scale=dynamic to let the scale find its level")
