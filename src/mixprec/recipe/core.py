"""Recipes: frozen, typed descriptions of how a model trains in mixed precision.

A recipe says in which dtype the weights are held, in which dtype the matmuls run, whether an fp32
master copy takes the optimizer step, how the loss is scaled and which modules stay fp32. Named recipes
cover the usual cases; one string grammar spells any recipe and ``str(recipe)`` prints it back::

    >>> r = get_recipe("fp16-pure")
    >>> str(r)
    'params=fp16,compute=fp16,master=fp32,scale=dynamic'
    >>> parse_recipe(str(r)) == r
    True
    >>> parse_recipe("params=bf16,compute=bf16,rounding=stochastic").name
    'bf16-sr'
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Iterable

import torch

from ..formats import FORMATS, Format
from ..casting.oplists import OpPolicy, check_op_names
from .fp8 import Fp8Config
from .scale import LossScaleConfig, LossScaleKind
from .moments import Moments
from ..casting.saved16 import Saved

__all__ = [
    "Precision", "Rounding", "LossScaleConfig", "Recipe", "RECIPES", "get_recipe", "parse_recipe",
    "split_top_level",
]


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

_KEYS = ("params", "compute", "master", "scale", "rounding", "fp32_modules", *_OP_KEYS, "modules", "fp8",
         "moments", "saved")


def get_recipe(spec: str | Recipe) -> Recipe:
    """A recipe from a name (``"fp16"``), a full string, or a Recipe (returned as is)."""
    if isinstance(spec, Recipe):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"recipe must be a name (e.g. 'fp16'), a recipe string or a Recipe, got "
                        f"{type(spec).__name__}")
    return parse_recipe(spec)


def parse_recipe(text: str) -> Recipe:
    """Parse a recipe name or ``key=value,...`` string; unknown names and keys list the valid ones.

    Keys: ``params``, ``compute`` (defaults to params), ``master`` (fp32|none, default none),
    ``scale`` (none | static:V | dynamic[(opts)]; default dynamic for fp16 compute, else none),
    ``rounding`` (nearest|stochastic|kahan), ``fp32_modules`` (class names joined by ``+``, or none),
    ``fp32_ops``/``low_ops``/``follow_ops`` (op names joined by ``+``), ``modules`` (``PATTERN:PRECISION``
    joined by ``+``), ``fp8`` (``current`` | ``delayed`` | ``rowwise`` | ``block`` | ``mxfp8`` | ``nvfp4``,
    with options: see ``Fp8Config``; default none),
    ``moments`` (fp32|bf16|bf16-sr|fp8: Adam's moments, see ``recipe/moments.py``; default fp32),
    ``saved`` (fp32|exact|low: fp32 activations saved in 16 bits, see ``saved16``; default fp32: as autograd saves them).
    A named recipe may lead, and the keys after it change it: ``bf16,fp32_ops=softmax`` is bf16 with
    softmax in fp32.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_recipe takes a recipe name or string (e.g. 'fp16' or 'params=fp32,compute=fp16'), "
                        f"got {type(text).__name__}; pass a Recipe to get_recipe, which returns it as is")
    text = text.strip()
    if text in RECIPES:
        return RECIPES[text]
    if "=" not in text:
        raise ValueError(f"unknown recipe {text!r}{_did_you_mean(text)}; named recipes: "
                         f"{', '.join(RECIPES)}; or spell one as params=..,compute=..,master=..,scale=..")
    fields: dict[str, str] = {}
    items = split_top_level(text)
    base = RECIPES.get(items[0]) if items and "=" not in items[0] else None
    if base is not None:
        items = items[1:]
    elif items and "=" not in items[0]:
        raise ValueError(f"unknown recipe {items[0]!r}{_did_you_mean(items[0])} in {text!r}; named "
                         f"recipes: {', '.join(RECIPES)}")
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in _KEYS:
            raise ValueError(f"unknown recipe key {key!r} in {text!r}; valid keys: {', '.join(_KEYS)}")
        if key in fields:
            raise ValueError(f"recipe key {key!r} given twice in {text!r}")
        fields[key] = value.strip()
    if base is not None:
        return _edit_named(base, fields)
    param = Precision.parse(fields.get("params", "fp32"), key="params")
    compute = Precision.parse(fields.get("compute", param.value), key="compute")
    master = _parse_master(fields.get("master", "none"))
    scale = LossScaleConfig.parse(fields["scale"]) if "scale" in fields else None   # None: the default
    try:
        rounding = Rounding(fields.get("rounding", "nearest"))
    except ValueError:
        raise ValueError(f"unknown rounding {fields['rounding']!r}; valid values: "
                         f"{', '.join(r.value for r in Rounding)}") from None
    modules = DEFAULT_FP32_MODULES
    if "fp32_modules" in fields:
        word = fields["fp32_modules"]
        modules = () if word == "none" else tuple(m for m in word.split("+") if m)
    fp8 = None
    if fields.get("fp8", "none") != "none":
        fp8 = Fp8Config.parse(fields["fp8"])
    recipe = Recipe(param=param, compute=compute, master=master, loss_scale=scale, rounding=rounding,
                    fp32_modules=modules, fp8=fp8, **_op_list_fields(fields), **_moments_field(fields))
    if (param.is_low and "master" not in fields and rounding is Rounding.NEAREST):
        raise ValueError(f"params={param.value} without a master copy loses every update smaller than "
                         f"half an ulp of the weight; add master=fp32 (fp32 copies take the step), "
                         + ("rounding=stochastic, rounding=kahan, " if param is Precision.BF16 else "")
                         + "or spell master=none to accept that")
    return recipe


def _moments_field(fields: dict[str, str]) -> dict:
    """``moments`` (recipe/moments.py) and ``saved`` (casting/saved16.py) from their words, when given."""
    out: dict = {"moments": Moments.parse(fields["moments"])} if "moments" in fields else {}
    if "saved" in fields:
        out["saved"] = Saved.parse(fields["saved"])
    return out


def _op_list_fields(fields: dict[str, str]) -> dict:
    """``fp32_ops``/``low_ops``/``follow_ops`` and ``modules`` from their words."""
    out: dict = {key: tuple(w.strip() for w in fields[key].split("+") if w.strip())
                 for key in _OP_KEYS if key in fields}
    if "modules" in fields:
        rules = []
        for word in filter(None, (w.strip() for w in fields["modules"].split("+"))):
            pattern, sep, precision = word.rpartition(":")
            if not sep:
                raise ValueError(f"modules={word}: give each module its precision as PATTERN:PRECISION, "
                                 "e.g. modules=lm_head:fp32+blocks.*.attn:bf16")
            rules.append((pattern.strip(), Precision.parse(precision, key=f"precision for {pattern}")))
        out["modules"] = tuple(rules)
    return out


def _parse_master(word: str) -> Precision | None:
    """``master=fp32`` or ``master=none``: the two a recipe takes (not every precision's name)."""
    if word.strip().lower() == "none":
        return None
    if word.strip().lower() == "fp32":
        return Precision.FP32
    raise ValueError(f"unknown master {word!r}; valid values: fp32, none")


def _edit_named(base: Recipe, fields: dict[str, str]) -> Recipe:
    """A named recipe with some keys changed: ``fp16,scale=static:1024``, ``bf16,fp32_ops=softmax``.

    The base is spelled in full (``str(base)``) and the given keys replace its own. What the base only
    had by default follows the edit: with ``params`` changed, a compute equal to the old params follows
    it and a master copy stays only if there was one and the weights stay 16-bit (``bf16-pure,
    params=fp16`` is fp16-pure; ``bf16,params=fp16`` must say its master); with ``params``, ``compute``
    or ``modules`` changed, a scale that was the old compute's default is re-decided; a ``scale=none``
    the base had by default never counts as the user accepting fp16 without a scale.
    """
    own = dict(item.partition("=")[::2] for item in split_top_level(str(base)))
    if "params" in fields:
        if base.compute is base.param:
            own.pop("compute")
        if base.master is None or Precision.parse(fields["params"], key="params") is Precision.FP32:
            own.pop("master")
    if {"params", "compute", "modules"} & set(fields):
        if own.get("scale") == ("dynamic" if base.compute is Precision.FP16 else "none"):
            own.pop("scale")
    if own.get("scale") == "none":
        own.pop("scale")        # bf16's scale=none is a default, not the user accepting fp16 without one
    return parse_recipe(",".join(f"{k}={v}" for k, v in (own | fields).items()))


def _did_you_mean(word: str) -> str:
    close = difflib.get_close_matches(word.strip().lower(), list(RECIPES), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses (``scale=dynamic(a=1,b=2)`` stays whole)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s for s in (s.strip() for s in items) if s]
