"""The loss-scale part of a recipe: ``LossScaleConfig`` and its words in the recipe grammar.

``scale=none``, ``scale=static:V`` and ``scale=dynamic(init=,growth=,backoff=,growth_interval=,
hysteresis=,floor=,ceiling=)``; ``str()`` prints the shortest exact text back (powers of two as 2**k)::

    >>> str(LossScaleConfig.parse("dynamic(hysteresis=2)"))
    'dynamic(hysteresis=2)'
    >>> LossScaleConfig.parse("static:2**10").init
    1024.0
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re

__all__ = ["LossScaleConfig", "LossScaleKind"]


class LossScaleKind(str, enum.Enum):
    """How the loss is scaled. A ``str`` enum: ``LossScaleKind.NONE == "none"``, so either spelling works."""

    NONE = "none"
    STATIC = "static"
    DYNAMIC = "dynamic"


_STATIC_MAX = 2.0**24


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """How the loss is scaled before backward.

    ``kind`` (a ``LossScaleKind``) is ``"none"``, ``"static"`` (multiply by ``init`` always) or ``"dynamic"`` (start at
    ``init``; on an overflow skip the step and, after ``hysteresis`` overflows without a growth in
    between, multiply by ``backoff``; after ``growth_interval`` clean steps in a row multiply by
    ``growth``; never leave ``[floor, ceiling]``).
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
        if not (math.isfinite(self.init) and self.init > 0):
            raise ValueError(f"loss scale init must be a finite positive number, got {self.init}")
        if self.kind == "dynamic":
            if not self.growth > 1.0:
                raise ValueError(f"loss scale growth must be > 1, got {self.growth}")
            if not 0.0 < self.backoff < 1.0:
                raise ValueError(f"loss scale backoff must be in (0, 1), got {self.backoff}")
            if self.growth_interval < 1 or self.hysteresis < 1:
                raise ValueError("loss scale growth_interval and hysteresis must be >= 1, got "
                                 f"{self.growth_interval} and {self.hysteresis}")
            if not (0.0 < self.floor <= self.init <= self.ceiling < math.inf):
                raise ValueError("loss scale needs 0 < floor <= init <= ceiling < inf, got "
                                 f"floor={self.floor}, init={self.init}, ceiling={self.ceiling}")

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "static":
            return f"static:{_num(self.init)}"
        default = LossScaleConfig()
        changed = [f"{f.name}={_num(getattr(self, f.name))}" for f in dataclasses.fields(self)
                   if f.name != "kind" and getattr(self, f.name) != getattr(default, f.name)]
        return "dynamic" + (f"({','.join(changed)})" if changed else "")

    @classmethod
    def parse(cls, text: str) -> LossScaleConfig:
        """``none`` | ``static:1024`` | ``dynamic`` | ``dynamic(hysteresis=2,init=1024)``."""
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
        m = re.fullmatch(r"dynamic(?:\((.*)\))?", text)
        if not m:
            raise ValueError(f"unknown loss scale {text!r}; valid forms: none, static:VALUE, dynamic, "
                             "dynamic(init=..,growth=..,backoff=..,growth_interval=..,hysteresis=..,"
                             "floor=..,ceiling=..)")
        kwargs: dict[str, float | int] = {}
        names = {f.name: f for f in dataclasses.fields(cls) if f.name != "kind"}
        for item in filter(None, (m.group(1) or "").split(",")):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"unknown dynamic loss scale option {item!r}; valid keys: "
                                 f"{', '.join(names)}")
            kwargs[key] = (int(_parse_float(value, key)) if key in ("growth_interval", "hysteresis")
                           else _parse_float(value, key))
        return cls(kind=LossScaleKind.DYNAMIC, **kwargs)


def _num(x: float) -> str:
    """Shortest exact text for a float: powers of two as 2**k, integers plainly."""
    if x > 0 and math.log2(x).is_integer() and abs(math.log2(x)) >= 12:
        return f"2**{int(math.log2(x))}"
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _parse_float(text: str, what: str) -> float:
    text = text.strip()
    try:
        if text.startswith("2**"):
            return 2.0 ** float(text[3:])
        return float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number (e.g. 1024 or 2**16), got {text!r}") from None
