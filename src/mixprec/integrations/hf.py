"""``MixedPrecisionTrainer``: Hugging Face's ``Trainer`` training under a mixprec recipe.

    from mixprec.integrations.hf import MixedPrecisionTrainer
    trainer = MixedPrecisionTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                    recipe="bf16-pure")
    trainer.train()

A small subclass, because a callback cannot do it: ``Trainer`` calls ``accelerator.backward``, clips
with ``accelerator.clip_grad_norm_`` and calls ``optimizer.step()`` itself, and each must change:

- **forward**: ``compute_loss_context_manager`` also enters the engine's autocast (training and
  evaluation alike, as the model will be served).
- **loss scaling**: ``compute_loss`` hands back the loss through an identity whose backward multiplies
  the gradient by the loss scale ``S``: the value Trainer logs is the true loss, and every
  ``backward`` Trainer runs (one per micro-batch under gradient accumulation) accumulates ``S``-scaled
  gradients, exactly as ``engine.backward`` would.
- **clipping**: ``TrainingArguments.max_grad_norm`` (1.0 by default) is handed to the engine, which
  clips the global norm of the *unscaled* gradients inside ``step()``; Trainer's own clipping (which
  would clip scaled gradients: a logged grad_norm of 86,383 under fp16) is switched off, and the
  grad_norm Trainer logs is the engine's unscaled one.
- **step**: Trainer's ``optimizer.step()`` runs ``engine.step()`` (unscale, clip, overflow check, step
  or skip, scale update); a skipped step does not advance the learning-rate schedule.
- **logging**: every training log also carries ``loss_scale`` and ``skipped_steps`` (TensorBoard,
  W&B and the console get them through Trainer's own callbacks).
- **checkpoints**: each checkpoint folder gets ``mixprec.pt`` (loss scale, master weights, fp8 scale
  histories), and ``resume_from_checkpoint`` restores it, so a resumed run continues bit for bit.
- **export**: ``save_model``/``save_pretrained`` through the trainer write fp32 weights, the master
  copies under pure recipes (``mixprec.checkpoint.export.fp32_state_dict``), never the bf16/fp16 rounding.
- **the loss**: a causal LM's own loss (``ForCausalLMLoss``) upcasts the logits and lets
  ``F.cross_entropy`` save fp32 log-probabilities: 4 bytes per token per vocabulary entry (Llama 3, 128k
  vocabulary, 8 x 4096 tokens: 16.8 GB). The trainer sets ``model.loss_function`` to
  :func:`causal_lm_loss`, the same loss through ``mixprec.cross_entropy``, which saves the 16-bit
  logits the model's output already holds; the gradient is the same bit for bit. ``chunked_loss=False``
  keeps the model's own. :func:`use_chunked_loss` does it for a loop of your own (Accelerate, plain torch).

The engine is built on the first training step, on the model and optimizer Accelerate prepared.
Leave ``TrainingArguments(fp16=..., bf16=...)`` off: the recipe is the precision.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError as exc:   # pragma: no cover - exercised where transformers is absent
    raise ImportError("mixprec.integrations.hf needs Hugging Face transformers: "
                      "pip install 'mixprec[hf]'") from exc

from ..casting.chunked_loss import cross_entropy
from ..engine import MixedPrecision, StepResult
from ..checkpoint.export import fp32_state_dict
from ..recipe import Recipe, get_recipe

__all__ = ["MixedPrecisionTrainer", "save_pretrained_fp32", "ENGINE_STATE_NAME", "causal_lm_loss",
           "use_chunked_loss"]

ENGINE_STATE_NAME = "mixprec.pt"     # the engine's state, beside Trainer's files in a checkpoint folder


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (next-token cross-entropy, labels shifted by one, mean over
    the counted tokens or sum / ``num_items_in_batch`` under gradient accumulation) without its fp32
    copy of the logits: :func:`mixprec.cross_entropy` computes in fp32 chunk by chunk and saves the
    logits as they are. Same signature, same value, the same gradient bit for bit."""
    if shift_labels is None:
        # Tokens < n predict n: pad the labels by one ignored position and drop the first.
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def use_chunked_loss(model: torch.nn.Module) -> bool:
    """Give a Hugging Face causal LM :func:`causal_lm_loss` as its ``loss_function``; True when it did.

    Only a model whose loss is transformers' own ``ForCausalLMLoss`` is changed: a custom loss, or
    another task's (sequence classification, masked LM), is left alone.
    """
    inner = getattr(model, "module", model)      # DDP / Accelerate wrappers
    own = getattr(inner, "loss_function", None)
    # Recognised by name, so that nothing more of transformers is imported than the model did.
    if getattr(own, "__name__", None) != "ForCausalLMLoss" or not own.__module__.startswith("transformers."):
        return False
    inner.loss_function = causal_lm_loss
    return True


def save_pretrained_fp32(engine: MixedPrecision, output_dir: str, **kwargs: Any) -> None:
    """``engine.model.save_pretrained(output_dir)`` with fp32 weights (the master copies under pure
    recipes) and ``dtype: float32`` in its config, so ``from_pretrained`` loads fp32 by default."""
    engine.model.save_pretrained(output_dir, state_dict=fp32_state_dict(engine), **kwargs)
    _mark_fp32(engine.model, output_dir)


def _mark_fp32(model: torch.nn.Module, output_dir: str) -> None:
    # save_pretrained writes the dtype of the model's first weight (fp16/bf16 under pure recipes) into
    # config.json, and from_pretrained(dtype="auto") would load the fp32 file in 16 bits.
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.dtype = "float32"
        config.save_pretrained(output_dir)


class _EngineOptimizer:
    """What Trainer holds as ``self.optimizer`` once the engine exists: ``step()`` is the engine's
    step; everything else (param_groups, state_dict, ...) is the prepared optimizer's."""

    def __init__(self, optimizer: Any, trainer: MixedPrecisionTrainer) -> None:
        self.__dict__["_inner"] = optimizer
        self.__dict__["_trainer"] = trainer

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._trainer._engine_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._trainer.mixprec.zero_grad(set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class MixedPrecisionTrainer(Trainer):
    """A ``transformers.Trainer`` that trains under ``recipe`` (a name, a recipe string or a Recipe).

    ``engine_options`` go to ``MixedPrecision`` (e.g. ``seed``, ``fp8_filter``). After training
    starts, ``trainer.mixprec`` is the engine and ``trainer.last_step`` the last ``StepResult``.
    """

    def __init__(self, *args: Any, recipe: str | Recipe = "bf16", engine_options: dict | None = None,
                 chunked_loss: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recipe = get_recipe(recipe)
        self.chunked_loss = chunked_loss and use_chunked_loss(self.model)
        if getattr(self.args, "fp16", False) or getattr(self.args, "bf16", False):
            raise ValueError("TrainingArguments has fp16=True or bf16=True: that turns on Accelerate's own "
                             "autocast and scaler beside mixprec's. Leave both off; the recipe "
                             f"{self.recipe.label!r} is the precision")
        for name in ("_clip_grad_norm", "_get_grad_norm", "_save", "_save_checkpoint", "_load_from_checkpoint"):
            if not hasattr(Trainer, name):
                raise ImportError(f"this transformers version's Trainer has no {name}(); "
                                  "MixedPrecisionTrainer needs transformers >= 5")
        self.engine_options = dict(engine_options or {})
        self.mixprec: MixedPrecision | None = None
        self.last_step: StepResult | None = None
        self._grad_norm_t: torch.Tensor | None = None
        self._resume_dir: str | None = None

    # ------------------------------------------------------------------------------ the engine
    def _ensure_engine(self) -> MixedPrecision:
        if self.mixprec is None:
            if self.optimizer is None:
                raise RuntimeError("MixedPrecisionTrainer builds its engine on Trainer's optimizer, and "
                                   "there is none yet: call trainer.train()")
            clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
            self.mixprec = MixedPrecision(self.model, self.optimizer, self.recipe, clip_grad_norm=clip,
                                          **self.engine_options)
            path = os.path.join(self._resume_dir, ENGINE_STATE_NAME) if self._resume_dir else None
            if path is not None and os.path.exists(path):
                self.mixprec.load_state_dict(torch.load(path, map_location=self.mixprec.device,
                                                        weights_only=False))
            self._grad_norm_t = torch.zeros((), dtype=torch.float32, device=self.mixprec.device)
            self.optimizer = _EngineOptimizer(self.optimizer, self)
        return self.mixprec

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
                      ) -> torch.Tensor:
        self._ensure_engine()
        return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        if self.mixprec is not None:
            stack.enter_context(self.mixprec.autocast())
        return stack

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     **kwargs: Any):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if self.mixprec is None or not torch.is_grad_enabled() or not model.training:
            return result
        loss, outputs = result if return_outputs else (result, None)
        loss = self.mixprec.scale_loss(loss, in_backward=True)   # logged unscaled, S-scaled gradients
        return (loss, outputs) if return_outputs else loss

    def _engine_step(self) -> None:
        result = self.mixprec.step()
        self.last_step = result
        self._grad_norm_t.copy_(result.grad_norm_t)     # what Trainer logs as grad_norm
        inner = self.optimizer._inner
        if hasattr(inner, "_is_overflow"):
            # Accelerate's optimizer reports a skipped step through this flag; Trainer then keeps the
            # learning-rate schedule where it was (one host sync, as torch's GradScaler path has).
            inner._is_overflow = result.skipped

    # Trainer's clipping would clip the S-scaled gradients: the engine clips the unscaled ones.
    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> torch.Tensor | None:
        # Filled by the engine's step, which runs right after this call and before Trainer reads it.
        return self._grad_norm_t

    # -------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.mixprec is not None and "loss" in logs:
            logs["loss_scale"] = self.mixprec.scale
            logs["skipped_steps"] = self.mixprec.skipped_steps
        super().log(logs, *args, **kwargs)

    # ---------------------------------------------------------------- checkpoints and export
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        exported = state_dict is None and self.mixprec is not None
        if exported:
            state_dict = fp32_state_dict(self.mixprec)
        super()._save(output_dir, state_dict=state_dict)
        if exported and self.args.should_save:
            _mark_fp32(self.model, output_dir or self.args.output_dir)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.mixprec is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            torch.save(self.mixprec.state_dict(), os.path.join(folder, ENGINE_STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.mixprec is not None:
            raise RuntimeError("resume_from_checkpoint on a trainer that has already trained: its model "
                               "is prepared for the recipe. Build a new MixedPrecisionTrainer to resume")
        self._resume_dir = resume_from_checkpoint
        super()._load_from_checkpoint(resume_from_checkpoint, model)
