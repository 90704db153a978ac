"""Recipes: how a model trains in mixed precision, as frozen data with one string grammar.

``core`` holds ``Recipe``, ``Precision``, ``Rounding`` and the named recipes; ``grammar`` the string
grammar (``parse_recipe``, ``get_recipe``); ``scale`` the loss-scale part (``scale=dynamic(...)``);
``fp8`` the fp8 part (``fp8=delayed(...)``); ``moments`` the optimizer-state part (``moments=bf16``).

May import: ``formats``, and the vocabulary of ``casting.oplists`` and ``casting.saved16`` (the op
names, ``OpPolicy``, ``Saved``) that the grammar spells; nothing that runs a model.
"""

from .core import DEFAULT_FP32_MODULES, RECIPES, Precision, Recipe, Rounding
from .grammar import get_recipe, parse_recipe, split_top_level
from ..casting.saved16 import Saved
from .fp8 import AmaxAlgorithm, Fp8Backend, Fp8Config, Fp8Scaling
from .moments import Moments
from .scale import LossScaleConfig, LossScaleKind

__all__ = ["Recipe", "RECIPES", "Precision", "Rounding", "get_recipe", "parse_recipe", "split_top_level",
           "DEFAULT_FP32_MODULES", "LossScaleConfig", "LossScaleKind", "Fp8Config", "Fp8Scaling",
           "AmaxAlgorithm", "Fp8Backend", "Moments", "Saved"]
