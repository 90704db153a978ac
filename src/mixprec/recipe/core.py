"""Recipes: frozen, typed descriptions of how a model trains in mixed precision.

A recipe says in which dtype the weights are held, in which dtype the matmuls run, whether an fp32
master copy takes the optimizer step, how the loss is scaled and which modules stay fp32. This module
holds ``Recipe`` (built canonical by its constructor, so equal recipes compare and print alike), the
enums it is made of (``Precision``, ``Rounding``) and the named recipes that cover the usual cases;
``grammar.py`` parses the one string grammar that spells any recipe, which ``str(recipe)`` prints::

    >>> r = RECIPES["fp16-pure"]
    >>> str(r)
    'params=fp16,compute=fp16,master=fp32,scale=dynamic'
    >>> r.name, Recipe(param=Precision.BF16, compute=Precision.BF16, rounding=Rounding.STOCHASTIC).name
    ('fp16-pure', 'bf16-sr')
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import torch

from ..formats import FORMATS, Format
from ..casting.oplists import OpPolicy, check_op_names
from .fp8 import Fp8Config
from .scale import LossScaleConfig, LossScaleKind
from .moments import Moments
from ..casting.saved16 import Saved

__all__ = ["Precision", "Rounding", "LossScaleConfig", "Recipe", "RECIPES", "DEFAULT_FP32_MODULES"]


class Precision(enum.Enum):
    """A floating-point precision for weights or compute."""

    FP32 = "fp32"
    TF32 = "tf32"   # fp32 storage; matmuls and convolutions on tensor cores with a 10-bit mantissa
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def format(self) -> Format:
        """The number format (``formats.FP16`` ...): limits, exact rounding."""
        return FORMATS[self.value]

    @property
    def dtype(self) -> torch.dtype:
        """The torch storage dtype (tf32 has none of its own: it is stored as float32)."""
        return self.format.torch_dtype or torch.float32

    @property
    def is_low(self) -> bool:
        """True for the 16-bit formats, the ones autocast and weight casting target."""
        return self in (Precision.FP16, Precision.BF16)

    @classmethod
    def parse(cls, word: str, *, key: str = "precision") -> Precision:
        try:
            return _PRECISION_WORDS[word.strip().lower()]
        except KeyError:
            raise ValueError(
                f"unknown {key} {word!r}; valid values: {', '.join(p.value for p in cls)}"
            ) from None


_PRECISION_WORDS = {p.value: p for p in Precision} | {
    "float32": Precision.FP32, "float16": Precision.FP16, "half": Precision.FP16,
    "bfloat16": Precision.BF16,
}


class Rounding(enum.Enum):
    """How the optimizer's fp32 result is rounded into low-precision weights without a master copy."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"   # unbiased: E[round(x)] == x, so small updates survive on average
    KAHAN = "kahan"             # nearest, the rounding error kept in a 16-bit compensation (update/kahan.py)



# The recipe keys that move ops between autocast's lists, and the list each moves them to.
_OP_KEYS = {"fp32_ops": OpPolicy.FP32, "low_ops": OpPolicy.LOW, "follow_ops": OpPolicy.FOLLOW}
# Module types kept in fp32 by pure recipes: normalisations reduce over many values (mean, variance)
# and their tiny affine parameters cost nothing in memory.
_FP16_DYNAMIC = LossScaleConfig(kind=LossScaleKind.DYNAMIC)
_NO_SCALE = LossScaleConfig(kind=LossScaleKind.NONE)
DEFAULT_FP32_MODULES = ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm", "LocalResponseNorm")


@dataclasses.dataclass(frozen=True, init=False)
class Recipe:
    """How a model trains: weights dtype, compute dtype, master copy, loss scale, fp32 modules.

    ``param`` is the dtype the model's weights are held in; ``compute`` the dtype autocast runs the
    matmuls in (fp32 and tf32 mean no autocast); ``master`` the dtype of the copy the optimizer updates
    (``None``: the optimizer updates the model's own weights); ``rounding`` how the fp32 optimizer result
    is rounded into low-precision weights when there is no master copy; ``fp32_modules`` names module
    classes (matched as a substring of the class name) whose weights and inputs stay fp32 in pure recipes.

    Op lists (see ``oplists``): ``fp32_ops``, ``low_ops`` and ``follow_ops`` move ops (torch function
    names) off torch.autocast's default lists, wherever autocast runs. ``modules`` sets the compute
    precision of modules and their children, for any recipe: ``(pattern, precision)`` pairs, the pattern
    an ``fnmatch`` glob over the qualified name (``blocks.*.attn``) or the class name (``LayerNorm``);
    the last matching pair wins, and it wins over ``fp32_modules``. In pure recipes a module set to fp32
    keeps fp32 weights, as ``fp32_modules`` ones do::

        >>> from mixprec.recipe import parse_recipe      # the grammar (recipe/grammar.py)
        >>> r = parse_recipe("bf16,fp32_ops=softmax+layer_norm,modules=lm_head:fp32")
        >>> r.fp32_ops, r.modules
        (('layer_norm', 'softmax'), (('lm_head', <Precision.FP32: 'fp32'>),))
    """

    param: Precision = Precision.FP32
    compute: Precision = Precision.FP32
    master: Precision | None = None
    loss_scale: LossScaleConfig = _NO_SCALE
    rounding: Rounding = Rounding.NEAREST
    fp32_modules: tuple[str, ...] = DEFAULT_FP32_MODULES
    fp32_ops: tuple[str, ...] = ()
    low_ops: tuple[str, ...] = ()
    follow_ops: tuple[str, ...] = ()
    modules: tuple[tuple[str, Precision], ...] = ()
    fp8: Fp8Config | None = None   # fp8 matmuls in eligible nn.Linear layers (recipe/fp8.py)
    moments: Moments = Moments.FP32  # Adam's moments: fp32 (the user's optimizer) or compact (recipe/moments.py)
    saved: Saved = Saved.FP32      # which fp32 activations autograd saves are kept in 16 bits (casting/saved16.py); none by default

    def __init__(self, param: Precision = Precision.FP32, compute: Precision = Precision.FP32,
                 master: Precision | None = None, loss_scale: LossScaleConfig | None = None,
                 rounding: Rounding = Rounding.NEAREST,
                 fp32_modules: Iterable[str] = DEFAULT_FP32_MODULES, fp32_ops: Iterable[str] = (),
                 low_ops: Iterable[str] = (), follow_ops: Iterable[str] = (),
                 modules: Iterable[tuple[str, Precision]] = (), fp8: Fp8Config | None = None,
                 moments: Moments = Moments.FP32, saved: Saved = Saved.FP32) -> None:
        """Build and check a recipe; every field is set once, here, in its canonical form.

        ``loss_scale=None`` takes the default: dynamic where anything computes in fp16 (``compute`` or a
        ``modules`` rule; small gradients would flush to zero without it), none otherwise. fp16 without scaling is spelled
        ``loss_scale=LossScaleConfig(kind="none")`` (``scale=none`` in the grammar). Op lists are kept
        sorted and without repeats, so equal edits compare equal and print alike.
        """
        modules = tuple(modules)
        if loss_scale is None:
            # fp16 anywhere (the compute, or a module set to fp16) needs a scale, or small gradients
            # flush to zero below 2**-24; bf16 and fp32 share fp32's exponent range and need none.
            fp16_anywhere = compute is Precision.FP16 or any(rule[-1] is Precision.FP16 for rule in modules)
            loss_scale = _FP16_DYNAMIC if fp16_anywhere else _NO_SCALE
        ops = {}
        for key in _OP_KEYS:
            given = {"fp32_ops": fp32_ops, "low_ops": low_ops, "follow_ops": follow_ops}[key]
            if isinstance(given, str):
                raise TypeError(f"Recipe.{key} takes op names as a tuple, e.g. ({given!r},), not a string")
            ops[key] = tuple(sorted(set(given)))
        if isinstance(fp32_modules, str):
            raise TypeError(f"Recipe.fp32_modules takes class names as a tuple, e.g. ({fp32_modules!r},)")
        fields = dict(param=param, compute=compute, master=master, loss_scale=loss_scale, rounding=rounding,
                      fp32_modules=tuple(fp32_modules), modules=modules, fp8=fp8, moments=moments,
                      saved=saved, **ops)
        for name, value in fields.items():
            object.__setattr__(self, name, value)   # frozen dataclass: the one assignment of each field
        self._check()

    def _check(self) -> None:
        if not isinstance(self.moments, Moments):
            raise TypeError(f"Recipe.moments must be a Moments, got {self.moments!r}")
        if not isinstance(self.saved, Saved):
            raise TypeError(f"Recipe.saved must be a Saved, got {self.saved!r}")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise TypeError(f"Recipe.fp8 must be an Fp8Config or None, got {self.fp8!r}")
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise TypeError(f"Recipe.loss_scale must be a LossScaleConfig or None, got {self.loss_scale!r}")
        if (self.fp8 is not None and self.fp8.delayed
                and self.loss_scale.kind is LossScaleKind.PER_LAYER):
            # Delayed scaling sets the e5m2 gradient scale from the amax history of earlier steps,
            # before a layer's factor changed: the factor's growth saturates the gradients (measured:
            # gradient error 0.99 against 0.33 without per-layer). Current scaling sees each factor.
            raise ValueError("fp8=delayed(...) and scale=per-layer do not compose: delayed scaling takes the "
                             "gradient scale from amaxes seen before a layer's factor changed, so the fp8 "
                             "gradients saturate; use fp8=current (e.g. 'fp8,scale=per-layer') or "
                             "scale=dynamic with fp8-delayed")
        self._check_op_lists_and_modules()
        for name in ("param", "compute"):
            if not isinstance(getattr(self, name), Precision):
                raise TypeError(f"Recipe.{name} must be a Precision, got {getattr(self, name)!r}")
        if self.param is Precision.TF32:
            raise ValueError("params=tf32 is not a storage format; use params=fp32,compute=tf32")
        if self.master not in (None, Precision.FP32):
            raise ValueError(f"master must be fp32 or none, got {self.master.value}")
        if self.master is not None and not self.param.is_low:
            raise ValueError(f"a master copy only makes sense for fp16/bf16 weights; params="
                             f"{self.param.value} needs master=none")
        if self.param.is_low and self.compute is not self.param:
            raise ValueError(f"params={self.param.value} needs compute={self.param.value}: low-precision "
                             "weights are multiplied in their own dtype")
        if self.rounding is not Rounding.NEAREST and (self.master is not None or not self.param.is_low):
            raise ValueError(f"rounding={self.rounding.value} applies to fp16/bf16 weights without a master "
                             "copy (master=none)")
        if self.rounding is not Rounding.NEAREST and self.param is not Precision.BF16:
            raise ValueError(f"rounding={self.rounding.value} is implemented for bf16 weights only (params=bf16)")

    def _check_op_lists_and_modules(self) -> None:
        seen: dict[str, str] = {}
        for key in _OP_KEYS:
            ops = getattr(self, key)
            check_op_names(ops, key=key)
            for op in ops:
                if op in seen:
                    raise ValueError(f"op {op!r} is in both {seen[op]} and {key}; put it on one list")
                seen[op] = key
        for rule in self.modules:
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], Precision)):
                raise TypeError(f"Recipe.modules holds (pattern, Precision) pairs, got {rule!r}")
            pattern, precision = rule
            if not pattern or any(c in pattern for c in ":+,= "):
                raise ValueError(f"module pattern {pattern!r} must be a non-empty name or glob without "
                                 "':', '+', ',', '=' or spaces, e.g. lm_head or blocks.*.attn")
            if precision is Precision.TF32:
                raise ValueError(f"modules={pattern}:tf32: a module's precision is fp32, fp16 or bf16")
            if self.param.is_low and precision not in (Precision.FP32, self.param):
                raise ValueError(f"modules={pattern}:{precision.value}: with params={self.param.value} a "
                                 f"module runs in fp32 (fp32 weights) or {self.param.value}")
        if seen and not (self.compute.is_low or any(p.is_low for _, p in self.modules)):
            raise ValueError("op list edits act where autocast runs; use compute=fp16 or bf16, or run "
                             "some modules in 16 bits (modules=PATTERN:bf16)")

    @property
    def op_edits(self) -> dict[str, OpPolicy]:
        """The edited ops and the list each is moved to (empty: autocast's default lists)."""
        return {op: policy for key, policy in _OP_KEYS.items() for op in getattr(self, key)}

    @property
    def autocast(self) -> bool:
        """True when torch.autocast casts the compute to fp16/bf16."""
        return self.compute.is_low

    @property
    def name(self) -> str | None:
        """The named recipe this equals, or ``None`` for a custom one."""
        return next((n for n, r in RECIPES.items() if r == self), None)

    @property
    def label(self) -> str:
        """The name where there is one, else the full string: for tables and plots."""
        return self.name or str(self)

    def __str__(self) -> str:
        parts = [f"params={self.param.value}", f"compute={self.compute.value}",
                 f"master={self.master.value if self.master else 'none'}", f"scale={self.loss_scale}"]
        if self.rounding is not Rounding.NEAREST:
            parts.append(f"rounding={self.rounding.value}")
        if self.fp32_modules != DEFAULT_FP32_MODULES:
            parts.append(f"fp32_modules={'+'.join(self.fp32_modules) or 'none'}")
        parts += [f"{key}={'+'.join(getattr(self, key))}" for key in _OP_KEYS if getattr(self, key)]
        if self.modules:
            parts.append("modules=" + "+".join(f"{p}:{prec.value}" for p, prec in self.modules))
        if self.fp8 is not None:
            parts.append(f"fp8={self.fp8}")
        if self.moments is not Moments.FP32:
            parts.append(f"moments={self.moments.value}")
        if self.saved is not Saved.FP32:
            parts.append(f"saved={self.saved.value}")
        return ",".join(parts)


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe(),
    "tf32": Recipe(compute=Precision.TF32),
    "fp16": Recipe(compute=Precision.FP16, loss_scale=_FP16_DYNAMIC),
    "bf16": Recipe(compute=Precision.BF16),
    "fp16-pure": Recipe(param=Precision.FP16, compute=Precision.FP16, master=Precision.FP32,
                        loss_scale=_FP16_DYNAMIC),
    "bf16-pure": Recipe(param=Precision.BF16, compute=Precision.BF16, master=Precision.FP32),
    "bf16-sr": Recipe(param=Precision.BF16, compute=Precision.BF16, rounding=Rounding.STOCHASTIC),
    # bf16 weights + int16 compensations: the fp32 value exactly, at 4 B/param (update/kahan.py).
    "bf16-kahan": Recipe(param=Precision.BF16, compute=Precision.BF16, rounding=Rounding.KAHAN),
    # fp8 on top of bf16 autocast: eligible linears in fp8, the rest (norms, softmax, loss) as bf16.
    "fp8": Recipe(compute=Precision.BF16, fp8=Fp8Config()),
    "fp8-delayed": Recipe(compute=Precision.BF16, fp8=Fp8Config.parse("delayed")),
    # Blocked scalings (recipe/fp8.py, fp8/blocked_linear.py), on the same bf16 base.
    "fp8-rowwise": Recipe(compute=Precision.BF16, fp8=Fp8Config.parse("rowwise")),
    "fp8-block": Recipe(compute=Precision.BF16, fp8=Fp8Config.parse("block")),
    "mxfp8": Recipe(compute=Precision.BF16, fp8=Fp8Config.parse("mxfp8")),
    "nvfp4": Recipe(compute=Precision.BF16, fp8=Fp8Config.parse("nvfp4")),
}
