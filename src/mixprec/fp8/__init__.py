"""fp8 training: per-tensor scaling (scaling.py), block scaling (blockscale.py: rowwise, 1x128/128x128,
MXFP8, NVFP4), scaled matmuls (matmul.py), the scale state every fp8 layer keeps (layer_state.py), the
fp8 linear layer (linear.py, with the blocked GEMMs in blocked_linear.py), a mixture of experts' grouped
GEMMs (grouped.py) and the Hugging Face experts modules that run them (experts.py), the swap of eligible ``nn.Linear`` layers (swap.py) with its report (swap_report.py), the scale
state in checkpoints (state.py) and per-layer scale/amax/headroom statistics (stats.py). The fp8 part of a
recipe, ``Fp8Config``, lives with the recipes (``mixprec.recipe.fp8``) and is re-exported here.

The engine swaps layers when a recipe has ``fp8=...``; these names are for users who want the layer,
the scales or the report on their own.

May import: ``formats``, ``fusion``, ``recipe``, ``devices`` and ``update.stochastic_rounding``; the engine
swaps its layers in, never the other way round.
"""

from ..recipe.fp8 import Fp8Config, Fp8Scaling
from .blocked_linear import BlockedRecipe, blocked_recipe
from .conv1d import Fp8Conv1D, is_hf_conv1d
from .grouped import Fp8GroupedLinear
from .layer_state import Fp8LayerState
from .linear import ROLES, Fp8Linear
from .matmul import emulated_mm, probe_scaled_mm, scaled_mm
from .scaling import amax_f32, cast_to_fp8, current_scale, delayed_scale, quantize_fp8, record_amax
from .stats import Fp8LayerStats, Fp8TensorStats, count_fp8_ranges, fp8_layer_stats
from .backends import resolve_backends
from .swap import resolve_backend, swap_to_fp8
from .swap_report import Fp8LayerDecision, Fp8Reason, Fp8SwapReport, Fp8UncoveredWeight

__all__ = [
    "Fp8Linear", "Fp8Conv1D", "Fp8GroupedLinear", "Fp8LayerState", "is_hf_conv1d", "ROLES", "probe_scaled_mm", "scaled_mm", "emulated_mm",
    "amax_f32", "current_scale", "delayed_scale", "record_amax", "cast_to_fp8", "quantize_fp8",
    "Fp8Reason", "Fp8LayerDecision", "Fp8UncoveredWeight", "Fp8SwapReport", "swap_to_fp8", "resolve_backend", "resolve_backends",
    "Fp8Config", "Fp8Scaling", "BlockedRecipe", "blocked_recipe",
    "Fp8LayerStats", "Fp8TensorStats", "fp8_layer_stats", "count_fp8_ranges",
]
