"""The recipe grammar: one string spells any recipe, and ``str(recipe)`` prints it back.

A string is a named recipe (``RECIPES``, in ``core.py``), ``key=value`` pairs joined by commas, or a
name followed by the keys that change it; each key's words are parsed by the part that owns them
(``scale=`` by ``scale.py``, ``fp8=`` by ``fp8.py``, ``moments=`` by ``moments.py``, ``saved=`` by
``casting/saved16.py``). Unknown names and keys list the valid ones::

    >>> r = get_recipe("fp16-pure")
    >>> str(r)
    'params=fp16,compute=fp16,master=fp32,scale=dynamic'
    >>> parse_recipe(str(r)) == r
    True
    >>> parse_recipe("params=bf16,compute=bf16,rounding=stochastic").name
    'bf16-sr'
    >>> parse_recipe("bf16,fp32_ops=softmax").fp32_ops
    ('softmax',)
"""

from __future__ import annotations

import difflib

from .core import _OP_KEYS, DEFAULT_FP32_MODULES, RECIPES, Precision, Recipe, Rounding
from .fp8 import Fp8Config
from .moments import Moments
from .scale import LossScaleConfig
from ..casting.saved16 import Saved

__all__ = ["get_recipe", "parse_recipe", "split_top_level"]

# The keys a recipe string may hold, in the order str(recipe) prints them.
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
