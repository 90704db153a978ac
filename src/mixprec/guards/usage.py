"""Catching the training-loop mistakes that give a wrong result without an error.

Each of these trains on, silently wrong, without a check:

- the forward ran outside ``mp.autocast()``: an fp16/bf16/fp8 recipe quietly computes in fp32;
- ``loss.backward()`` instead of ``mp.backward(loss)`` under a loss scale: the gradients are not
  multiplied by S, but ``step()`` still divides by S (65536 for fp16), so training stalls;
- ``step()`` twice without a new backward: the same (stale) gradients are applied twice;
- every step skipped for inf/NaN gradients: nothing moves and, without a dynamic scale at its floor,
  nothing says so;
- ``model.half()`` (or ``.to(dtype)``) after the engine was built: the recipe's fp32 weights become
  16-bit with no master copy behind them, so small updates round away (or every step overflows);
- ``optimizer.step()`` instead of ``mp.step()`` where the engine must do the step: after
  ``mp.backward`` under a loss scale the gradients carry S (65536 under fp16, so SGD moves the
  weights S times too far and no inf/NaN step is skipped); under a master copy the optimizer holds
  fp32 copies that only ``mp.step()`` fills and rounds back. A step pre-hook on the optimizer refuses
  the call.

The checks cost no host-device sync: the optimizer guard reads one Python flag per ``optimizer.step()``
(and is not installed at all where a bare step is correct, e.g. ``bf16``); the next three read Python-side flags and the gradients'
version counters (host metadata, bumped by every in-place write such as backward's accumulation);
the skip watch keeps a device counter of consecutive skips and reads it only where reading is free
(a CPU tensor, a count the generic step already synced for, or a non-blocking copy that has landed).
Under ``torch.compile`` the checks that read version counters are left out (they would break the
graph); the flags still work.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from torch.utils.hooks import RemovableHandle

import torch

__all__ = ["UsageChecks", "SKIP_WARNING_AFTER", "bare_step_reason", "check_param_dtypes", "foreign_params_message",
           "no_grads_message",
           "remember_engine", "frozen_model_message", "check_loss_tensor"]

# Consecutive skipped steps before the warning. A dynamic fp16 scale skips a few steps while it
# settles (each halves S); ten in a row means S fell 1024-fold or there is no scale to adjust.
SKIP_WARNING_AFTER = 10


# The step guard each optimizer carries: a later engine on the same optimizer replaces the earlier
# one's (else the old engine's flag, never set again, would refuse the new engine's steps).
_GUARDS: weakref.WeakKeyDictionary[Any, RemovableHandle] = weakref.WeakKeyDictionary()


# Per model (weakly keyed), the recipe and fp32 master-copy ids of the engine last built on it, so that a
# second engine on the same model and optimizer is told what the optimizer holds (the first engine's fp32
# copies), not that it holds parameters of another model.
_ENGINES: weakref.WeakKeyDictionary[Any, tuple[str, frozenset[int]]] = weakref.WeakKeyDictionary()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_param_dtypes(model: Any, recipe: Any, low: list[Any]) -> None:
    """ValueError for a parameter whose dtype the recipe would not train right; changes nothing.

    The recipe decides the weights' dtype. Every recipe without 16-bit weights (fp32, tf32, fp16 and bf16
    autocast, fp8) trains fp32 weights: a 16-bit weight would be stepped with no fp32 master copy (small
    updates round away), a float64 one is left alone by autocast (the recipe would change nothing). A
    pure recipe casts ``low`` (the weights it puts in 16 bits) from fp32 itself; such a weight already in
    the recipe's own 16-bit dtype is taken as it is (its fp32 master copy is its exact upcast: nothing
    is lost from there on, as after a 16-bit checkpoint). The weights a pure recipe keeps fp32 (norms,
    ``modules=...:fp32``) must be fp32: they are stepped without a master copy.
    """
    low_ids = {id(p) for p in low}
    fp32 = torch.float32
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.dtype == fp32:
            continue
        is_low = id(p) in low_ids
        if is_low and p.dtype == recipe.param.dtype:
            continue
        have = _dtype_name(p.dtype)
        if is_low:
            why = (f"recipe {recipe.label!r} casts the weights to {recipe.param.value} itself, from fp32 (or "
                   f"takes them already in {recipe.param.value}), and keeps an fp32 copy of each")
        elif recipe.param.is_low:
            why = (f"recipe {recipe.label!r} keeps this weight in fp32 (its module is in fp32_modules or an "
                   "fp32 modules= rule) and steps it with no master copy, so it must be fp32")
        elif p.dtype == torch.float64:
            why = (f"recipe {recipe.label!r} trains fp32 weights, and autocast leaves float64 ops in float64: "
                   "the recipe would change nothing")
        else:
            why = (f"recipe {recipe.label!r} trains fp32 weights (autocast computes in "
                   f"{recipe.compute.value} per op): a {have} weight would be stepped with no fp32 master "
                   f"copy, and updates smaller than half its last bit would round away")
        others = sum(1 for _, q in model.named_parameters() if q.is_floating_point() and q.dtype == p.dtype)
        fix = "build MixedPrecision on the fp32 model (call model.float() before it)"
        if not recipe.param.is_low and p.dtype != torch.float64:
            fix += (f"; for {have} weights with fp32 master copies pick "
                    f"'{'bf16' if p.dtype == torch.bfloat16 else 'fp16'}-pure' instead")
        raise ValueError(f"parameter {name!r} is {have} ({others} parameter{'s' if others > 1 else ''} of "
                         f"{type(model).__name__} {'are' if others > 1 else 'is'} {have}), but {why}: {fix}")


def remember_engine(model: Any, engine: Any) -> None:
    """Note what ``engine`` put in its optimizer for ``model`` (for ``foreign_params_message``): its recipe
    and the ids of its fp32 master copies, which live as long as that optimizer. Not the engine itself:
    it holds the model, so it would keep its own key alive, and every engine ever built with it."""
    masters = frozenset(id(m) for m in engine.master.masters) if engine.master is not None else frozenset()
    _ENGINES[model] = (engine.recipe.label, masters)


def foreign_params_message(model: Any, optimizer: Any, foreign: list[Any], total: int) -> str:
    """Why the optimizer holds tensors that are not ``model``'s, and what to do."""
    label, masters = _ENGINES.get(model, ("", frozenset()))
    if masters and all(id(p) in masters for p in foreign):
        return (f"this optimizer already belongs to a MixedPrecision engine built on this "
                f"{type(model).__name__} under recipe {label!r}: it holds that engine's fp32 "
                f"master copies ({len(foreign)} of its {total} tensors) and the model's weights are already "
                "16-bit. Keep using the first engine (one engine per model and optimizer), or build a new "
                "fp32 model and optimizer for a new engine")
    return (f"the optimizer holds {len(foreign)} of {total} parameters that are not "
            f"{type(model).__name__}'s: build it from this model, e.g. "
            f"{type(optimizer).__name__}(model.parameters(), ...), before MixedPrecision")


def check_loss_tensor(loss: Any, method: str) -> None:
    """TypeError unless ``loss`` is a floating-point tensor (``mp.backward`` and ``mp.scale_loss`` take it)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{method}() needs the loss as a tensor, got {type(loss).__name__}")
    if not loss.dtype.is_floating_point:     # an attribute: no call (mp.backward runs this every step)
        raise TypeError(f"the loss has dtype {loss.dtype}; it must be floating point (compute it "
                        "from the model's output, e.g. with F.cross_entropy)")


def frozen_model_message(model: Any) -> str | None:
    """The error for a model with no parameter that requires grad (nothing can train), else None."""
    if any(p.requires_grad for p in model.parameters()):
        return None
    return (f"every parameter of {type(model).__name__} has requires_grad=False (frozen), so the loss has "
            "no gradient and nothing can train: unfreeze the parameters to train "
            "(p.requires_grad_(True)) before the forward")


def bare_step_reason(recipe: Any, scaled: bool, master: bool, moments: bool) -> tuple[str | None, bool]:
    """Why a bare ``optimizer.step()`` trains wrong under this engine (None where it is correct), and
    whether always (True) or only on gradients ``mp.backward`` scaled (False)."""
    if master:
        return (f"under recipe {recipe.label!r} the optimizer holds fp32 copies of the 16-bit weights, which "
                "only mp.step() fills with gradients and rounds back into the model: a bare step would "
                "leave the model unchanged", True)
    if moments:
        return (f"recipe {recipe.label!r} keeps Adam's moments compact in the engine's own AdamW: a bare "
                "step would run your optimizer's own update instead", True)
    if scaled:
        # After loss.backward() (no scale) a bare step is the user's own autocast loop: left alone.
        return ("mp.backward() multiplied these gradients by the loss scale S (65536 at the start under "
                "fp16): the update would be S times too large, unclipped, and a step with inf/NaN "
                "gradients would not be skipped", False)
    return None, False


def _autocast_query_ok(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)     # torch >= 2.4 takes a device type
        return True
    except TypeError:
        return False


def _never_compiling() -> bool:
    return False


# torch.compiler.is_compiling itself (torch >= 2.3), called straight from the checks: no wrapper call
# of ours in every step.
_compiling = getattr(torch.compiler, "is_compiling", None) or _never_compiling


class UsageChecks:
    """The engine's misuse checks, kept out of ``step()`` so the step reads top to bottom."""

    def __init__(self, recipe: Any, scaled: bool, device: torch.device) -> None:
        # fp16/bf16 autocast or fp8 layers: forgetting mp.autocast() changes what is computed.
        self.needs_autocast = recipe.autocast or recipe.fp8 is not None
        # What running outside autocast means: fp32 compute, or (pure recipes: 16-bit weights) no op lists.
        self.outside = (f"without autocast's op lists (ops that need fp32, such as softmax and losses, ran "
                        f"in {recipe.param.value})" if recipe.param.is_low else
                        "in fp32, not in the recipe's precision")
        self.scaled = scaled            # a loss scale S != 1 is in force (static or dynamic)
        self.entered_autocast = False   # mp.autocast() entered since the last step()
        self.via_engine = False         # mp.backward() called since the last step()
        self.warned_autocast = False
        self.stepped_grads: list[tuple[Any, int]] | None = None   # (weakref, version) after a step
        self.skip_run = torch.zeros((), dtype=torch.int64, device=device)   # consecutive skips
        self.skip_run_py = 0            # the same count where the step already knows it on the host
        self._on_cuda = self.skip_run.device.type == "cuda"
        self._host: torch.Tensor | None = None      # CUDA: the pinned copy of skip_run, one step late
        self.traced = False             # the engine traces inf/NaN (trace_nonfinite=True)
        self.warned_skips = False
        self.in_engine_step = False     # mp.step() is calling the optimizer: the guard lets it through
        self.bare_step_reason: str | None = None
        self.bare_step_always = False   # else refused only on gradients mp.backward() scaled
        self.dtype_probes: tuple = ()     # (name, parameter, dtype as built), the first of each dtype
        self.optimizer: Any = None      # watch_optimizer: its param groups, counted as the engine left them
        self.n_groups = 0
        self.known: set[int] = set()    # tensors the optimizer may step: what it held, the fp32 weights

    def watch_optimizer(self, optimizer: Any, known: set[int]) -> None:
        """Note how many param groups ``optimizer`` has; ``known`` are the ids of the tensors it may step
        (what it holds now, the model's fp32 weights). ``add_param_group`` later is checked at step()."""
        self.optimizer, self.n_groups, self.known = optimizer, len(optimizer.param_groups), known

    def _check_param_groups(self) -> None:
        # Called when the group count changed (one int compare per step otherwise): a tensor the engine
        # did not see would be stepped without its fp32 copy, or is not the model's at all.
        unknown = [(i, t) for i, g in enumerate(self.optimizer.param_groups) for t in g["params"]
                   if id(t) not in self.known]
        if unknown:
            i, t = unknown[0]
            raise RuntimeError(
                f"the optimizer holds {len(unknown)} tensor{'s' if len(unknown) > 1 else ''} that MixedPrecision "
                f"did not see when it was built (param group {i}: a {_dtype_name(t.dtype)} tensor of shape "
                f"{tuple(t.shape)}): was optimizer.add_param_group() called after it? The engine sets up "
                "the optimizer's tensors once (fp32 master copies of 16-bit weights, the loss scale's "
                "unscaling), so a tensor added later would be stepped without them. Add every param group "
                "before building MixedPrecision (or build a new model, optimizer and engine)")
        self.n_groups = len(self.optimizer.param_groups)

    def remember_dtype(self, model: Any) -> None:
        """Note, as the recipe left them, the dtype of the first parameter of each floating dtype the
        model holds: a cast of the whole model changes at least one of them. Under a pure recipe the
        first parameter is already 16-bit, so ``model.half()`` shows only on what it keeps fp32 (norms).
        """
        probes: dict[torch.dtype, tuple] = {}
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype not in probes:
                probes[param.dtype] = (name, param, param.dtype)
        self.dtype_probes = tuple(probes.values())

    def check_dtype(self) -> None:
        """Refuse a model cast after the engine was built (a dtype compared per dtype held: host metadata, no sync).

        Checked at step() and on entering mp.autocast(): under a pure recipe the forward itself fails
        after model.half() (a norm kept fp32 gets fp16 weights), with torch's "mixed dtype" error.
        """
        for name, param, built in self.dtype_probes:    # at most one per dtype: two or three compares
            if param.dtype == built:
                continue
            raise RuntimeError(
                f"the model's parameters changed dtype after MixedPrecision was built ({name!r} was "
                f"{str(built).removeprefix('torch.')}, now {str(param.dtype).removeprefix('torch.')}): was "
                "model.half() or model.to(dtype) called after it? The recipe decides the weights' dtype: "
                "build the engine on the fp32 model and pick a recipe that keeps 16-bit weights with fp32 "
                "master copies (e.g. 'fp16-pure', 'bf16-pure') instead of casting the model yourself")

    # ----------------------------------------------------------------- the optimizer guard
    def guard_optimizer(self, optimizer: Any, reason: tuple[str | None, bool]) -> None:
        """Make a bare ``optimizer.step()`` raise (with ``bare_step_reason``'s text) unless ``mp.step()``
        is calling it: always, or (under a loss scale alone) when ``mp.backward`` made the gradients.

        The hook goes on the innermost torch optimizer (Accelerate's wrapper delegates its step to it),
        and replaces a guard an earlier engine left there. ``reason`` None installs nothing: a bare step
        is correct under that recipe, and the step pays not even a Python call.
        """
        while not hasattr(optimizer, "_optimizer_step_pre_hooks") and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        old = _GUARDS.pop(optimizer, None)
        if old is not None:
            old.remove()
        self.bare_step_reason, self.bare_step_always = reason
        if self.bare_step_reason is not None and hasattr(optimizer, "register_step_pre_hook"):
            _GUARDS[optimizer] = optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # One Python flag per optimizer.step(); raising here leaves weights and state untouched.
        if not self.in_engine_step and (self.bare_step_always or self.via_engine):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() was called directly, but {self.bare_step_reason}. "
                "Call mp.step() instead: it unscales, clips, skips inf/NaN steps and calls "
                "optimizer.step() itself")

    # ------------------------------------------------------------- forward and backward
    def on_backward(self) -> None:
        """mp.backward() was called; warn once if the forward ran outside mp.autocast()."""
        self.via_engine = True
        if self.needs_autocast and not self.entered_autocast and not self.warned_autocast:
            self.warned_autocast = True
            # Only what is known is said: mp.autocast() was not entered. A torch.autocast of the user's
            # own may have run the forward in 16 bits (then the recipe's op lists and fp8 layers did not).
            own = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if _autocast_query_ok(d))
            how = ("a torch.autocast of your own is on here, so the forward ran in its dtype and op lists, "
                   "not the recipe's" if own else
                   f"without an autocast of your own the forward ran {self.outside}; under a "
                   "torch.autocast of your own, in its dtype and op lists, not the recipe's")
            warnings.warn(
                f"mp.backward() was called but mp.autocast() was not entered since the last step: {how}. "
                "Run the forward inside `with mp.autocast():`", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ before the step
    def check_before_step(self, model_grads: list[torch.Tensor]) -> None:
        """Refuse a step whose gradients did not come from a new mp.backward(), or a model cast after the
        engine was built (one dtype compared: host metadata). Changes nothing."""
        if self.optimizer is not None and len(self.optimizer.param_groups) != self.n_groups:
            self._check_param_groups()
        self.check_dtype()
        if self.via_engine:
            return
        if not _compiling() and self._same_grads_as_last_step(model_grads):
            raise RuntimeError(
                "step() was called again without a new backward: these gradients were already applied "
                "by the last step. Call mp.zero_grad(), then mp.backward(loss), once per step()")
        if self.scaled:
            raise RuntimeError(
                "step() found gradients that did not come from mp.backward(loss): under a loss scale "
                "step() divides them by S, so loss.backward() would leave them S times too small. "
                "Call mp.backward(loss) instead of loss.backward()")

    def _same_grads_as_last_step(self, grads: list[torch.Tensor]) -> bool:
        # The same tensor objects with the same version counters: no backward wrote to them since.
        if self.stepped_grads is None or len(grads) != len(self.stepped_grads):
            return False
        return all(ref() is g and g._version == version
                   for (ref, version), g in zip(self.stepped_grads, grads))

    # ------------------------------------------------------------------- after the step
    def after_step(self, model_grads: list[torch.Tensor], found_inf: torch.Tensor,
                   stepped: bool | None) -> None:
        """Reset the per-step flags, remember the gradients, count consecutive skips.

        ``stepped`` is the host's answer where the step already synced for it (generic path), else
        None: then a device counter is kept and read only when that read is free.
        """
        self.entered_autocast = self.via_engine = False
        if not _compiling():
            self.stepped_grads = [(weakref.ref(g), g._version) for g in model_grads]
        if self.warned_skips:
            return
        if stepped is None and found_inf.device.type == "cpu":
            stepped = not bool(found_inf)     # a CPU tensor: reading it waits on nothing
        if stepped is not None:
            self.skip_run_py = 0 if stepped else self.skip_run_py + 1
            run = self.skip_run_py
        else:
            # run = (run + 1) * skipped: 0 after a step, one more after a skip; two tiny ops, no sync.
            self.skip_run.add_(1).mul_(found_inf)
            run = self._read_run_if_free()
        if run is not None and run >= SKIP_WARNING_AFTER:
            self.warned_skips = True
            self.warn_skips(run)

    def _read_run_if_free(self) -> int | None:
        """The consecutive-skip count as an earlier step's copy left it in pinned host memory, then a
        new copy issued behind this step's kernels: no sync, three calls.

        The value read is that of the last copy the GPU has finished (a step late, or more where the
        GPU runs behind the host): an 8-byte aligned word, written whole. The warning it feeds fires
        that much later, which loses nothing. (It was an event per copy, queried each step: 58 Python
        calls a step on the H200, 2026-11-28, for torch.cuda's stream and event wrappers.)
        """
        if not self._on_cuda:
            return None
        host = self._host
        if host is None:
            host = self._host = torch.zeros((), dtype=torch.int64, pin_memory=True)
        run = int(host)
        host.copy_(self.skip_run, non_blocking=True)
        return run

    def warn_skips(self, run: int) -> None:
        warnings.warn(
            f"{run} steps in a row were skipped for inf/NaN gradients: the weights have not changed "
            "since. A loss scale cannot fix a NaN from the forward (a log of 0, a division by zero, "
            "a too-high learning rate). " + ("mp.last_overflow names" if self.traced else
            "Build MixedPrecision(..., trace_nonfinite=True) and read mp.last_overflow to see") +
            " the module and op where the first inf/NaN appeared",
            RuntimeWarning, stacklevel=4)


def no_grads_message(model: Any, checks: UsageChecks) -> str:
    """Why step() found no gradients, as precisely as the engine knows."""
    frozen = frozen_model_message(model)
    if frozen is not None:
        return f"step() found no gradients: {frozen}"
    if checks.via_engine:
        return (f"step() found no gradients on {type(model).__name__}'s parameters although "
                "mp.backward(loss) was called: was the loss computed from another model's output (this "
                "engine steps the model it was built on), or from its parameters only through detached "
                "tensors? Build one engine per model")
    return "step() found no gradients: call mp.backward(loss) before mp.step()"
