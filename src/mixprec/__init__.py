"""mixprec: mixed-precision training for PyTorch that shows where precision hurts."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .devices import Support, supports
from .dist_checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from .distributed import fsdp_policy, shard_model, wrap_ddp
from .engine import MixedPrecision, StepResult
from .formats import (BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, TF32, Format, RangeCounts,
                      classify, get_format, quantize)
from .loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale
from .recipe import RECIPES, LossScaleConfig, Precision, Recipe, Rounding, get_recipe, parse_recipe

__version__ = "0.1.0"

__all__ = [
    "MixedPrecision", "StepResult",
    "Recipe", "RECIPES", "Precision", "Rounding", "LossScaleConfig", "get_recipe", "parse_recipe",
    "LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale",
    "save_checkpoint", "load_checkpoint", "CheckpointError",
    "shard_model", "wrap_ddp", "fsdp_policy", "save_distributed_checkpoint", "load_distributed_checkpoint",
    "supports", "Support",
    "Format", "FORMATS", "FP32", "TF32", "FP16", "BF16", "FP8_E4M3", "FP8_E5M2", "get_format",
    "quantize", "classify", "RangeCounts",
]
