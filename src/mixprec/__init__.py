"""mixprec: mixed-precision training for PyTorch that shows where precision hurts.

The front door holds what a training loop needs: the engine, recipes, number formats, checkpoints,
``memory_report`` and the errors. The subpackages export their own names: ``mixprec.diagnostics``
(range statistics, NaN/Inf origin, tensor cores, op traces), ``mixprec.fp8`` (fp8 layers, scales,
statistics), ``mixprec.distributed`` (FSDP2, DDP, sharded checkpoints); ``mixprec.loss_scale`` and
``mixprec.formats`` hold the loss-scale classes and the format arithmetic.
"""

import importlib as _importlib
import warnings as _warnings

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .checkpoint_read import CheckpointInfo, read_checkpoint
from .chunked_loss import cross_entropy
from .devices import Support, supports
from .diagnostics.memory_report import MemoryReport, memory_report
from .engine import Fp8EmulationWarning, MixedPrecision, StepResult
from .formats import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, TF32, Format, get_format
from .oplists import autocast_op_lists
from .recipe import RECIPES, Fp8Config, LossScaleConfig, Precision, Recipe, get_recipe, parse_recipe

__version__ = "0.1.0"

__all__ = [
    # the loop
    "MixedPrecision", "StepResult",
    # recipes
    "Recipe", "RECIPES", "get_recipe", "parse_recipe", "Precision", "LossScaleConfig", "Fp8Config",
    "autocast_op_lists",
    # the loss, in fp32 without a full fp32 copy of the logits
    "cross_entropy",
    # number formats
    "Format", "FORMATS", "get_format", "FP32", "TF32", "FP16", "BF16", "FP8_E4M3", "FP8_E5M2",
    # checkpoints, memory, capabilities
    "save_checkpoint", "load_checkpoint", "read_checkpoint", "CheckpointInfo", "memory_report", "MemoryReport",
    "supports", "Support",
    # the errors and warnings
    "CheckpointError", "Fp8EmulationWarning",
]

# Names the front door held before it was narrowed: they still work, with a DeprecationWarning
# that says where each one lives now.
_MOVED = {
    **dict.fromkeys(["Rounding", "Fp8Scaling"], "mixprec.recipe"),
    **dict.fromkeys(["OpPolicy", "OpLists"], "mixprec.oplists"),
    **dict.fromkeys(["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale"], "mixprec.loss_scale"),
    **dict.fromkeys(["quantize", "classify", "RangeCounts"], "mixprec.formats"),
    **dict.fromkeys(["Fp8Linear", "Fp8SwapReport", "Fp8LayerDecision", "Fp8Reason", "fp8_layer_stats",
                     "count_fp8_ranges", "Fp8LayerStats", "Fp8TensorStats"], "mixprec.fp8"),
    **dict.fromkeys(["shard_model", "wrap_ddp", "fsdp_policy", "save_distributed_checkpoint",
                     "load_distributed_checkpoint"], "mixprec.distributed"),
    **dict.fromkeys(["RangeCollector", "RangesResult", "update_lost", "ScaleWindow", "scale_window",
                     "NonfiniteTracer", "NonfiniteOrigin", "trace_matmuls", "TensorCoreReport",
                     "trace_ops", "OpTrace", "OpRecord"], "mixprec.diagnostics"),
}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    _warnings.warn(f"mixprec.{name} moved to {module}.{name}; import it from there (the old name will "
                   "be removed in a later release)", DeprecationWarning, stacklevel=2)
    return getattr(_importlib.import_module(module), name)


def __dir__() -> list:
    return sorted([*__all__, *_MOVED, "__version__"])
