"""mixprec: mixed-precision training for PyTorch that shows where precision hurts."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .devices import Support, supports
from .diagnostics.fp8 import Fp8LayerStats, Fp8TensorStats, count_fp8_ranges, fp8_layer_stats
from .diagnostics.memory_report import MemoryReport, memory_report
from .diagnostics.nonfinite import NonfiniteOrigin, NonfiniteTracer
from .diagnostics.optrace import OpRecord, OpTrace, trace_ops
from .diagnostics.ranges import RangeCollector, RangesResult, update_lost
from .diagnostics.scale_window import ScaleWindow, scale_window
from .diagnostics.tensor_cores import TensorCoreReport, trace_matmuls
from .dist_checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from .distributed import fsdp_policy, shard_model, wrap_ddp
from .engine import Fp8EmulationWarning, MixedPrecision, StepResult
from .formats import (BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, TF32, Format, RangeCounts,
                      classify, get_format, quantize)
from .fp8 import Fp8LayerDecision, Fp8Linear, Fp8Reason, Fp8SwapReport
from .loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale
from .oplists import OpLists, OpPolicy, autocast_op_lists
from .recipe import RECIPES, LossScaleConfig, Precision, Recipe, Rounding, get_recipe, parse_recipe
from .recipe_fp8 import Fp8Config, Fp8Scaling

__version__ = "0.1.0"

__all__ = [
    # the engine and its recipes
    "MixedPrecision", "StepResult", "Fp8EmulationWarning",
    "Recipe", "RECIPES", "Precision", "Rounding", "LossScaleConfig", "get_recipe", "parse_recipe",
    "OpPolicy", "OpLists", "autocast_op_lists", "Fp8Config", "Fp8Scaling",
    "LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale",
    "save_checkpoint", "load_checkpoint", "CheckpointError",
    "supports", "Support",
    # number formats
    "Format", "FORMATS", "FP32", "TF32", "FP16", "BF16", "FP8_E4M3", "FP8_E5M2", "get_format",
    "quantize", "classify", "RangeCounts",
    # fp8 layers
    "Fp8Linear", "Fp8SwapReport", "Fp8LayerDecision", "Fp8Reason",
    # distributed
    "shard_model", "wrap_ddp", "fsdp_policy", "save_distributed_checkpoint", "load_distributed_checkpoint",
    # diagnostics
    "RangeCollector", "RangesResult", "update_lost", "ScaleWindow", "scale_window",
    "NonfiniteTracer", "NonfiniteOrigin", "trace_matmuls", "TensorCoreReport", "memory_report", "MemoryReport",
    "trace_ops", "OpTrace", "OpRecord",
    "fp8_layer_stats", "count_fp8_ranges", "Fp8LayerStats", "Fp8TensorStats",
]
