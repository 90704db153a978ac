"""mixprec: mixed-precision training for PyTorch that shows where precision hurts.

The front door holds what a training loop needs: the engine, recipes, number formats, checkpoints,
``memory_report`` and the errors. The subpackages export their own names: ``mixprec.diagnostics``
(range statistics, NaN/Inf origin, tensor cores, op traces), ``mixprec.fp8`` (fp8 layers, scales,
statistics), ``mixprec.distributed`` (FSDP2, DDP, sharded checkpoints); ``mixprec.loss_scale`` and
``mixprec.formats`` hold the loss-scale classes and the format arithmetic.
"""

import importlib as _importlib
import importlib.abc
import importlib.util
import sys as _sys
import warnings as _warnings

from .checkpoint.files import load_checkpoint, save_checkpoint
from .checkpoint.verified import CheckpointError
from .checkpoint.read import CheckpointInfo, read_checkpoint
from .casting.chunked_loss import cross_entropy
from .devices import Support, supports
from .diagnostics.memory_report import MemoryReport, memory_report
from .engine import Fp8EmulationWarning, MixedPrecision, StepResult
from .formats import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, TF32, Format, get_format
from .casting.oplists import autocast_op_lists
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
    **dict.fromkeys(["OpPolicy", "OpLists"], "mixprec.casting.oplists"),
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


# Modules the flat core held before it was grouped into packages (mixprec.X -> mixprec.Y): ``import
# mixprec.master`` and ``from mixprec.master import ...`` still work, with a DeprecationWarning naming
# the new home. ``mixprec.loss_scale`` and ``mixprec.checkpoint`` are packages now and export what the
# modules did; ``mixprec.casting``'s functions live in ``mixprec.casting.model``.
_MOVED_MODULES = {
    "bit_views": "update.bit_views", "operands": "update.operands", "kahan": "update.kahan",
    "stochastic_rounding": "update.stochastic_rounding", "compact_adamw": "update.compact_adamw",
    "master": "update.master", "buffers": "casting.buffers", "oplists": "casting.oplists",
    "saved16": "casting.saved16", "chunked_loss": "casting.chunked_loss", "tf32": "casting.tf32",
    "layer_scale": "loss_scale.per_layer", "layer_graph": "loss_scale.layer_graph",
    "optimizer_step": "step.optimizer", "step_compile": "step.compiled", "step_result": "step.result",
    "grad_norm": "step.grad_norm", "grad_sync": "step.grad_sync", "usage_checks": "guards.usage",
    "nonfinite": "guards.nonfinite", "module_scope": "guards.module_scope",
    "checkpoint_check": "checkpoint.check", "checkpoint_values": "checkpoint.values",
    "checkpoint_read": "checkpoint.read", "export": "checkpoint.export",
}


class _MovedModule(_importlib.abc.MetaPathFinder, _importlib.abc.Loader):
    """Finds ``mixprec.X`` for a moved module X and hands back the module at its new path."""

    def find_spec(self, fullname, path, target=None):
        if fullname.removeprefix("mixprec.") not in _MOVED_MODULES:
            return None
        return _importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = "mixprec." + _MOVED_MODULES[spec.name.removeprefix("mixprec.")]
        _warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed "
                       "in a later release)", DeprecationWarning, stacklevel=2)
        return _importlib.import_module(new)

    def exec_module(self, module):
        pass                                   # the module at the new path is already executed


_sys.meta_path.append(_MovedModule())


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    _warnings.warn(f"mixprec.{name} moved to {module}.{name}; import it from there (the old name will "
                   "be removed in a later release)", DeprecationWarning, stacklevel=2)
    return getattr(_importlib.import_module(module), name)


def __dir__() -> list:
    return sorted([*__all__, *_MOVED, "__version__"])
