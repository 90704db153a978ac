"""``MixedPrecisionPlugin``: a Lightning ``Precision`` plugin that trains under a mixprec recipe.

    import lightning as L
    from mixprec.integrations.lightning import MixedPrecisionPlugin
    trainer = L.Trainer(plugins=[MixedPrecisionPlugin("fp16-pure")], gradient_clip_val=1.0)
    trainer.fit(module, loader)

Lightning's loops stay as they are; the plugin takes the precision-specific parts:

- the forward of every training/validation/test/predict step runs in the engine's autocast;
- ``pre_backward`` multiplies the loss by the loss scale ``S`` (the logged loss is the unscaled one
  your ``training_step`` returned);
- ``optimizer_step`` runs the closure (forward, backward), Lightning's ``on_before_optimizer_step``
  hooks and clipping, then ``engine.step()``: unscale, clip the *unscaled* gradients by norm
  (``gradient_clip_val``), overflow check, step or skip, scale update;
- the engine's state (loss scale, master weights, fp8 scale histories) is the plugin's
  ``state_dict``, so Lightning checkpoints hold it and ``ckpt_path=`` resumes it.

The engine is built when Lightning connects the plugin to the LightningModule and its optimizer
(``connect``, during the trainer's setup: one optimizer, automatic optimization), before the first
forward. So with ``accumulate_grad_batches=k`` every micro-batch of the first optimizer step already
runs under the recipe: the loss scale multiplies each micro-batch's loss, pure recipes have cast the
weights, fp8 layers are swapped. ``metrics``, a ``mixprec.integrations.logging.MetricsLogger``,
receives every step's loss scale, skip flag and grad norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

try:
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as exc:   # pragma: no cover - exercised where lightning is absent
    raise ImportError("mixprec.integrations.lightning needs Lightning: pip install 'mixprec[lightning]'") from exc

from ..engine import MixedPrecision, StepResult
from ..recipe import Recipe, get_recipe

__all__ = ["MixedPrecisionPlugin"]


class MixedPrecisionPlugin(Precision):
    """Train a LightningModule under ``recipe`` (a name, a recipe string or a Recipe)."""

    precision = "32-true"    # what Lightning stores and compares: mixprec handles the low precision itself

    def __init__(self, recipe: str | Recipe = "bf16", *, metrics: Any = None, **engine_options: Any) -> None:
        super().__init__()
        self.recipe = get_recipe(recipe)
        self.engine_options = engine_options
        self.metrics = metrics
        self.engine: MixedPrecision | None = None
        self.last_step: StepResult | None = None
        self._module: torch.nn.Module | None = None
        self._pending_state: dict | None = None
        self._clip: float | None = None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self._module = module      # the engine casts it (pure recipes) when it is built
        return module

    def connect(self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
                ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Build the engine now, before the first micro-batch (Lightning calls this in its setup, after
        the optimizers exist and the model is on its device). Without optimizers (validate, test,
        predict) nothing is built and the forward runs in the recipe's autocast."""
        if optimizers:
            if len(optimizers) > 1:
                raise ValueError(f"MixedPrecisionPlugin drives one optimizer; configure_optimizers returned "
                                 f"{len(optimizers)}")
            # The LightningModule itself (convert_module saw it), not a DDP wrapper around it.
            self._ensure_engine(self._module if self._module is not None else model, optimizers[0])
        return model, optimizers, lr_schedulers

    def _ensure_engine(self, model: Any, optimizer: Any) -> MixedPrecision:
        if self.engine is None:
            if not getattr(model, "automatic_optimization", True):
                raise ValueError("MixedPrecisionPlugin supports automatic optimization only; for manual "
                                 "optimization use mixprec.MixedPrecision in your training_step")
            self.engine = MixedPrecision(model, optimizer, self.recipe, **self.engine_options)
            if self._pending_state is not None:
                self.engine.load_state_dict(self._pending_state)
                self._pending_state = None
        elif optimizer is not self.engine.optimizer:
            raise ValueError("MixedPrecisionPlugin drives one optimizer, and its engine was built on another "
                             "(configure_optimizers returned several, or a second fit made a new one): "
                             "give each Trainer a new MixedPrecisionPlugin")
        return self.engine

    # ------------------------------------------------------------------------------ forward
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.engine is not None:
            return self.engine.autocast()
        # No engine (trainer.validate/test/predict without a fit: no optimizer): the recipe's autocast.
        device = next((p.device for p in self._module.parameters()), torch.device("cpu")) \
            if self._module is not None else torch.device("cpu")
        return torch.autocast(device.type, dtype=self.recipe.compute.dtype if self.recipe.autocast else None,
                              enabled=self.recipe.autocast)

    # ----------------------------------------------------------------------------- backward
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.engine is not None:
            tensor = self.engine.scale_loss(tensor)   # loss * S: S-scaled gradients
        return super().pre_backward(tensor, module)

    # --------------------------------------------------------------------------------- step
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        engine = self._ensure_engine(model, optimizer)
        closure_result = closure()                         # training_step, backward
        if closure_result is None and model.automatic_optimization:
            return None                                   # training_step returned None: nothing to step
        self._clip = None
        self._after_closure(model, optimizer)             # hooks, then clip_gradients below
        engine.clip_grad_norm = self._clip
        result = engine.step()
        engine.zero_grad()        # the 16-bit model gradients too: Lightning zeroes the optimizer's only
        self.last_step = result
        if self.metrics is not None:
            self.metrics.log_step(engine, result, step=getattr(model.trainer, "global_step", None))
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0,
                       gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM) -> None:
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ValueError("MixedPrecisionPlugin clips the global norm of the unscaled gradients inside "
                             "the engine's step; use gradient_clip_algorithm='norm'")
        self._clip = float(clip_val)    # handed to engine.step(), which clips after unscaling

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.engine is not None:
            return self.engine.state_dict()
        return self._pending_state or {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.engine is not None:
            self.engine.load_state_dict(state_dict)
        else:
            self._pending_state = state_dict     # applied when the engine is built

