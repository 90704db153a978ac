"""The fp8 part of a recipe: how fp8 linears scale their tensors and which layers become fp8.

A recipe with ``fp8=...`` runs eligible ``nn.Linear`` layers as low-precision matmuls; everything
else runs as the rest of the recipe says (bf16 autocast for the named ``fp8``, ``fp8-delayed``,
``fp8-rowwise``, ``fp8-block``, ``mxfp8`` and ``nvfp4``). The value is one word with optional
options, and ``str()`` prints it back::

    >>> cfg = Fp8Config.parse("delayed(history=4,amax=recent,pow2=true,skip=lm_head+*.c_proj)")
    >>> str(cfg)
    'delayed(history=4,amax=recent,pow2=true,skip=lm_head+*.c_proj)'
    >>> str(Fp8Config())
    'current'
    >>> str(Fp8Config.parse("nvfp4(sr=true,rht=false)"))       # sr=true is nvfp4's default
    'nvfp4(rht=false)'

**Different formats on different layers.** ``layers=PATTERN:SCALING+...`` gives the layers whose
qualified name matches a glob a scaling of their own; the first rule that matches decides, a layer no
rule matches takes the leading word's scaling, and ``skip`` (the base recipe) wins over every rule::

    >>> cfg = Fp8Config.parse("rowwise(skip=lm_head,layers=blocks.*.mlp.c_fc:mxfp8+blocks.0.*:current)")
    >>> cfg.scaling_for("blocks.1.mlp.c_fc").value, cfg.scaling_for("blocks.1.attn.c_proj").value
    ('mxfp8', 'rowwise')
    >>> str(cfg.for_layer("blocks.0.attn.c_attn"))            # the layer's own config: defaults, same backend
    'current'

A rule's layers take their scaling with its defaults (``history``, ``amax``, ``margin``, ``pow2``,
``sr`` and ``rht`` given in the parentheses apply to the leading word's layers only); ``backend``
applies to all. ``mixprec plan`` writes recipes in this form.

Two families. **Per tensor** (``current``, ``delayed``): inputs and weights in e4m3, output gradients
in e5m2, one fp32 scale per tensor. **Blocked** (``fp8/blocked_linear.py``): one scale per block of
each GEMM operand, blocks laid along that GEMM's contraction dimension, so an outlier costs the
precision of its own block only:

    rowwise   e4m3 everywhere, one power-of-two fp32 scale per row of each operand
    block     e4m3 everywhere, fp32 scales: 1x128 tiles of activations and gradients, 128x128 weight blocks
    mxfp8     e4m3 in 32-element blocks with e8m0 (power-of-two) scales (OCP MX)
    nvfp4     e2m1 (4-bit) in 16-element blocks, e4m3 block scales times an fp32 tensor scale,
              16x16 weight tiles; ``sr``: stochastic rounding of the gradients, ``rht``: a random
              Hadamard transform on both inputs of the weight-gradient GEMM (both on by default)

A blocked scaling fixes its own scales: ``history``, ``amax``, ``margin`` and ``pow2`` apply to the
per-tensor ones, ``sr`` and ``rht`` to nvfp4; elsewhere they are an error that says so.

Scaling, for a tensor ``x`` cast to format F (max 448 for e4m3, 57344 for e5m2)::

    current:  scale = F.max / amax(x) / 2**margin
    delayed:  scale = F.max / A / 2**margin, A = max(history) or history[0] (the most recent),
              the history holding the amaxes of the previous casts of this tensor

``pow2=true`` rounds the scale down to a power of two (then ``x * scale`` and its inverse are exact).
The fallbacks that keep an amax of 0, inf or NaN from poisoning the scale are in ``fp8/scaling.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import re

__all__ = ["Fp8Scaling", "Fp8Config", "AmaxAlgorithm", "Fp8Backend"]


class Fp8Scaling(enum.Enum):
    """Where the scales of an fp8 linear come from: one per tensor, or one per block of each operand."""

    CURRENT = "current"   # amax of this tensor now: one extra read of it per cast
    DELAYED = "delayed"   # amax history of earlier casts (Transformer Engine's default recipe)
    ROWWISE = "rowwise"   # e4m3, a power-of-two scale per row along the contraction dim (torchao rowwise)
    BLOCK = "block"       # e4m3, 1x128 activation/gradient tiles, 128x128 weight blocks (DeepSeek-V3)
    MXFP8 = "mxfp8"       # e4m3, 32-element blocks, e8m0 scales (OCP MX)
    NVFP4 = "nvfp4"       # e2m1, 16-element blocks, e4m3 scales x an fp32 tensor scale; SR and RHT

    @property
    def blocked(self) -> bool:
        """True for the scalings with one scale per block (fp8/blocked_linear.py), not per tensor."""
        return self not in (Fp8Scaling.CURRENT, Fp8Scaling.DELAYED)


# What each blocked scaling fixes, for the errors that refuse a per-tensor option on it.
_BLOCKED_SCALES = {
    Fp8Scaling.ROWWISE: "one power-of-two fp32 scale per row",
    Fp8Scaling.BLOCK: "fp32 scales per 1x128 tile and 128x128 weight block",
    Fp8Scaling.MXFP8: "e8m0 scales per 32 elements",
    Fp8Scaling.NVFP4: "e4m3 scales per 16 elements times an fp32 tensor scale",
}


class AmaxAlgorithm(str, enum.Enum):
    """Which amax of the history a delayed scale is computed from (a ``str`` enum: ``== "max"`` works)."""

    MAX = "max"         # the largest in the history: safe against a growing tensor
    RECENT = "recent"   # the most recent: follows a shrinking tensor sooner


class Fp8Backend(str, enum.Enum):
    """Which matmul runs the fp8 layers (a ``str`` enum: ``== "auto"`` works)."""

    AUTO = "auto"             # the faster of the two where scaled_mm runs (measured on a CPU), else emulate
    SCALED_MM = "scaled_mm"   # torch._scaled_mm, or an error where the device cannot run it
    EMULATE = "emulate"       # exact fp8 rounding (formats.quantize) then an fp32 matmul

_BOOL_WORDS = {"true": True, "false": False}


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """How fp8 linears scale, and which ``nn.Linear`` layers are swapped for them.

    ``history`` (delayed only): how many earlier amaxes are kept; ``amax`` (delayed only): ``max`` of
    the history or the most ``recent`` entry; ``margin`` (per-tensor only): scale down by ``2**margin``
    to leave headroom; ``pow2`` (per-tensor only): round scales down to powers of two. ``sr`` and
    ``rht`` (nvfp4 only, ``None`` elsewhere; True unless set): stochastic rounding of the gradient
    operands, random Hadamard transform of the weight-gradient GEMM's inputs. Layer selection:
    ``skip`` (qualified-name globs left in the base recipe), ``skip_first``/``skip_last`` (the model's
    first/last ``nn.Linear`` in module order), ``force`` (exact names that must become fp8: an error if one cannot),
    ``layers`` (``(glob, Fp8Scaling)`` rules: a scaling per layer, the first match deciding). ``backend``:
    ``scaled_mm`` (``torch._scaled_mm``), ``emulate`` (``formats.quantize`` then an fp32 matmul) or
    ``auto`` (the faster of the two: scaled_mm on CUDA 8.9+, measured once per process on a CPU;
    the emulation where scaled_mm cannot run; a notice says when the emulation was chosen, and why).
    """

    scaling: Fp8Scaling = Fp8Scaling.CURRENT
    history: int = 16
    amax: AmaxAlgorithm = AmaxAlgorithm.MAX
    margin: int = 0
    pow2: bool = False
    sr: bool | None = None      # nvfp4 only: None becomes True there (see __post_init__)
    rht: bool | None = None     # nvfp4 only: likewise
    skip: tuple[str, ...] = ()
    skip_first: bool = False
    skip_last: bool = False
    force: tuple[str, ...] = ()
    layers: tuple[tuple[str, Fp8Scaling], ...] = ()   # (glob, scaling) rules: the first match decides
    backend: Fp8Backend = Fp8Backend.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.scaling, Fp8Scaling):
            raise TypeError(f"Fp8Config.scaling must be an Fp8Scaling, got {self.scaling!r}")
        for name in ("history", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"fp8 {name} must be an integer, got {value!r}")
        if self.history < 1:
            raise ValueError(f"fp8 history must be >= 1, got {self.history}")
        if not 0 <= self.margin <= 16:
            raise ValueError(f"fp8 margin must be in 0..16 (scale divided by 2**margin), got {self.margin}")
        for name, kind in (("amax", AmaxAlgorithm), ("backend", Fp8Backend)):
            if getattr(self, name) not in tuple(kind):
                raise ValueError(f"unknown fp8 {name} {getattr(self, name)!r}; valid values: "
                                 f"{', '.join(k.value for k in kind)}")
        if not self.delayed and (self.history != 16 or self.amax != "max"):
            raise ValueError("fp8 history and amax apply to delayed scaling; write "
                             "fp8=delayed(history=..,amax=..) or drop them")
        self._check_blocked_options()
        clash = set(self.skip) & set(self.force)
        if clash:
            raise ValueError(f"fp8 layers {sorted(clash)} are both skipped and forced; keep one")
        for word in self.skip + self.force:
            if not word or any(c in word for c in "+,()=:"):
                raise ValueError(f"fp8 layer name {word!r} is empty or holds one of + , ( ) = :")
        self._check_layer_rules()

    def _check_layer_rules(self) -> None:
        """``layers`` holds (glob, Fp8Scaling) pairs with distinct globs."""
        seen = set()
        for rule in self.layers:
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)
                    and isinstance(rule[1], Fp8Scaling)):
                raise TypeError(f"Fp8Config.layers holds (pattern, Fp8Scaling) pairs, got {rule!r}")
            pattern, _ = rule
            if not pattern or any(c in pattern for c in "+,()=: "):
                raise ValueError(f"fp8 layers rule pattern {pattern!r} must be a non-empty name or glob without "
                                 "'+', ',', '(', ')', '=', ':' or spaces, e.g. blocks.*.mlp.c_fc")
            if pattern in seen:
                raise ValueError(f"fp8 layers rule {pattern!r} is given twice; keep one")
            seen.add(pattern)

    def _check_blocked_options(self) -> None:
        """Per-tensor options on a blocked scaling and nvfp4's options elsewhere are errors; nvfp4's
        ``sr``/``rht`` left ``None`` become True (so ``nvfp4`` and ``nvfp4(sr=true)`` compare equal)."""
        name = self.scaling.value
        if self.scaling.blocked and (self.margin != 0 or self.pow2):
            raise ValueError(f"fp8 margin and pow2 apply to per-tensor scaling (current, delayed); {name} "
                             f"fixes its own scales ({_BLOCKED_SCALES[self.scaling]}): drop them")
        for key in ("sr", "rht"):
            value = getattr(self, key)
            if self.scaling is Fp8Scaling.NVFP4:
                if value is None:
                    object.__setattr__(self, key, True)     # frozen: the one assignment, here
                elif not isinstance(value, bool):
                    raise TypeError(f"fp8 {key} must be True or False, got {value!r}")
            elif value is not None:
                what = ("stochastic rounding of the gradients" if key == "sr" else
                        "a random Hadamard transform on the weight gradient's GEMM")
                raise ValueError(f"fp8 {key} ({what}) applies to nvfp4 only, not to {name}; write "
                                 f"fp8=nvfp4({key}=...) or drop it")

    @property
    def delayed(self) -> bool:
        return self.scaling is Fp8Scaling.DELAYED

    @property
    def blocked(self) -> bool:
        """True for ``rowwise``, ``block``, ``mxfp8`` and ``nvfp4``: scales per block, not per tensor."""
        return self.scaling.blocked

    @property
    def scalings(self) -> tuple[Fp8Scaling, ...]:
        """Every scaling this config can give a layer: the leading one, then the rules' (no repeats)."""
        return tuple(dict.fromkeys((self.scaling, *(s for _, s in self.layers))))

    def rule_for(self, name: str) -> tuple[str, Fp8Scaling] | None:
        """The first ``layers`` rule whose glob matches the qualified name ``name``, or None."""
        return next((r for r in self.layers if fnmatch.fnmatchcase(name, r[0])), None)

    def scaling_for(self, name: str) -> Fp8Scaling:
        """The scaling the layer named ``name`` takes (its rule's, else the leading one)."""
        rule = self.rule_for(name)
        return self.scaling if rule is None else rule[1]

    def for_layer(self, name: str) -> Fp8Config:
        """The config one layer is built with: this one without rules (and without the layer selection,
        which the swap has applied), or its rule's scaling with that scaling's defaults."""
        return self.only(self.scaling_for(name))

    def only(self, scaling: Fp8Scaling) -> Fp8Config:
        """The config of the layers that take ``scaling`` (no rules, no layer selection): the leading
        scaling with its options, another with its defaults; ``backend`` kept."""
        if scaling is self.scaling:
            return dataclasses.replace(self, layers=(), skip=(), force=(), skip_first=False, skip_last=False)
        return Fp8Config(scaling=scaling, backend=self.backend)

    def __str__(self) -> str:
        default = Fp8Config(scaling=self.scaling)
        opts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "scaling" or value == getattr(default, f.name):
                continue
            if isinstance(value, bool):
                value = str(value).lower()
            elif isinstance(value, enum.Enum):
                value = value.value
            elif f.name == "layers":
                value = "+".join(f"{pattern}:{scaling.value}" for pattern, scaling in value)
            elif isinstance(value, tuple):
                value = "+".join(value)
            opts.append(f"{f.name}={value}")
        return self.scaling.value + (f"({','.join(opts)})" if opts else "")

    @classmethod
    def parse(cls, text: str) -> Fp8Config:
        """A scaling word (``current``, ``delayed``, ``rowwise``, ``block``, ``mxfp8``, ``nvfp4``), optionally
        with ``(key=value,...)``; unknown words list the valid ones."""
        if not isinstance(text, str):
            raise TypeError(f"an fp8 scaling is spelled as a string (e.g. 'delayed(history=16)'), got "
                            f"{type(text).__name__}")
        text = text.strip()
        m = re.fullmatch(r"(\w+)(?:\((.*)\))?", text)
        scalings = ", ".join(s.value for s in Fp8Scaling)
        if not m or m.group(1) not in {s.value for s in Fp8Scaling}:
            raise ValueError(f"unknown fp8 scaling {text!r}; valid values: {scalings}, each optionally "
                             "with options, e.g. fp8=delayed(history=16,amax=max,margin=0,pow2=true) or "
                             "fp8=nvfp4(sr=true,rht=false)")
        kwargs: dict[str, object] = {"scaling": Fp8Scaling(m.group(1))}
        names = [f.name for f in dataclasses.fields(cls) if f.name != "scaling"]
        for item in filter(None, (s.strip() for s in (m.group(2) or "").split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in names:
                raise ValueError(f"unknown fp8 option {item!r}; valid keys: {', '.join(names)}")
            if key in kwargs:
                raise ValueError(f"fp8 option {key!r} given twice in {text!r}")
            if key in ("history", "margin"):
                try:
                    kwargs[key] = int(value)
                except ValueError:
                    raise ValueError(f"fp8 {key} must be an integer, got {value!r}") from None
            elif key in ("pow2", "sr", "rht", "skip_first", "skip_last"):
                if value.lower() not in _BOOL_WORDS:
                    raise ValueError(f"fp8 {key} must be true or false, got {value!r}")
                kwargs[key] = _BOOL_WORDS[value.lower()]
            elif key in ("skip", "force"):
                kwargs[key] = tuple(v for v in value.split("+") if v)
            elif key == "layers":
                kwargs[key] = _parse_layer_rules(value)
            else:
                kind = AmaxAlgorithm if key == "amax" else Fp8Backend
                if value not in tuple(kind):
                    raise ValueError(f"unknown fp8 {key} {value!r}; valid values: "
                                     f"{', '.join(k.value for k in kind)}")
                kwargs[key] = kind(value)
        return cls(**kwargs)  # type: ignore[arg-type]


def _parse_layer_rules(value: str) -> tuple[tuple[str, Fp8Scaling], ...]:
    """``blocks.*.mlp.c_fc:mxfp8+lm_head:current`` -> ``(("blocks.*.mlp.c_fc", MXFP8), ...)``."""
    rules = []
    scalings = ", ".join(s.value for s in Fp8Scaling)
    for word in filter(None, (w.strip() for w in value.split("+"))):
        pattern, sep, scaling = word.rpartition(":")
        if not sep or not pattern:
            raise ValueError(f"fp8 layers={word}: give each rule as PATTERN:SCALING, e.g. "
                             f"layers=blocks.*.mlp.c_fc:mxfp8+lm_head:rowwise (scalings: {scalings}; "
                             "skip= keeps layers in the base recipe)")
        if scaling not in {s.value for s in Fp8Scaling}:
            raise ValueError(f"fp8 layers={word}: unknown scaling {scaling!r}; valid values: {scalings} "
                             "(skip= keeps layers in the base recipe)")
        rules.append((pattern.strip(), Fp8Scaling(scaling)))
    return tuple(rules)
