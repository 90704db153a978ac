"""Per-layer loss scaling: the global dynamic scale S, and inside each layer a power-of-two factor r of its own.

One S must suit every layer: it grows until the layer with the largest gradients nears fp16's max, and a
layer whose weight gradients are 2**20 times smaller then computes them below fp16's smallest subnormal
(2**-24): they flush to zero. Zhao et al. (arXiv 1910.12385) scale each layer by its own statistics.
Here, for any model graph (residuals, branches, tied weights, in-place ops):

- S scales the loss as ``scale=dynamic`` does; the gradient flowing between layers carries S.
- A *layer* is a module that owns trainable parameters directly and has no descendant that does
  (modules sharing a parameter, a tied embedding and head, form one). Its forward hooks (edge_hooks.py)
  mark its region of the autograd graph: the gradient entering it (at its outputs) is multiplied by r,
  the gradient leaving it (at its inputs) divided by r, so its weight gradients are computed at S*r and
  nothing outside changes. r is a power of two in [1, 2**15]: both products are exact in fp16, barring range.
- ``step()`` divides each layer's fp32 gradients by r (exact), then unscales, clips and skips as usual.

r follows its layer's peak: the largest |gradient| inside it (weight gradients, gradients entering and
leaving it), in true units. After the layer's first clean step, and every ``growth_interval`` clean
steps after, r becomes the largest power of two that keeps that peak at most 2**-4 of fp16's max under
the current S: tiny gradients get a large factor, large ones keep 1. Any inf/NaN skips the step. If it
arose inside a layer whose incoming gradient was finite and whose r is above 1, that layer pays (r
halves, ``backoff`` rounded down to a power of two) and S is spared; else S backs off by the dynamic
rule (hysteresis, floor). With every r at 1 a run is the global dynamic scale's, bit for bit::

    >>> import mixprec
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    >>> with torch.no_grad():
    ...     _ = model[1].weight.mul_(1e-4)     # layer 0's gradients come out 1e4 times smaller
    >>> mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16,scale=per-layer")
    >>> x = torch.randn(8, 4)
    >>> for _ in range(2):                     # step 1 overflows at S = 2**16 (skipped); step 2 sets r
    ...     with mp.autocast():
    ...         loss = model(x).square().mean()
    ...     mp.backward(loss); _ = mp.step(); mp.zero_grad()
    >>> mp.scale, mp.loss_scale.layer_factors()
    (32768.0, {'0': 16384.0, '1': 1.0})

Off (any other ``scale=``) installs nothing. On, each layer's backward adds two multiplies and two
min/max reads of the gradients entering and leaving it, the step one max-norm and one multiply over the
weight gradients (fp16-pure keeps its fp32 gradient copies whole for it): on the lab's gpt (CPU, one
thread) a step costs 1.06x scale=dynamic's under fp16, 1.20x under fp32 compute. The first backward walks
the autograd graph once (``check_graph``) and refuses, naming the parameter, a model that would mix
scales (a parameter used outside its module's forward); a layer that makes one of its outputs from
another (Mixtral's router: logits and the top-k weights made from them) is kept at S instead (``_pin``).
Under ``torch.compile`` on torch 2.13 the hooks compile (``fullgraph=True``) and the walk is skipped,
with a warning (run the first step uncompiled for the check);
torch 2.15's dynamo refuses a tensor hook that writes into a buffer (the peaks), so there only
``mp.compile_step()`` compiles, not the model.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn  # noqa: F401  (the docstring's example uses it)

from ..step.grad_sync import SyncKind
from .edge_hooks import LayerEdgeHooks
from .layer_graph import Layer, OutputsFeedEachOther, check_graph, find_layers
from .scales import DynamicLossScale
from ..recipe import LossScaleConfig, LossScaleKind

if TYPE_CHECKING:
    from ..engine import MixedPrecision

__all__ = ["LayerLossScale", "MAX_FACTOR"]

# The largest factor: r and 1/r are then both exact fp16 values, so multiplying a 16-bit gradient by
# either is exact whatever the device does with a 0-d fp32 operand (CUDA casts it to fp16 first).
MAX_FACTOR = 2.0**15
# A layer's factor is set so its largest gradient, at S*r, sits at most 2**-4 below fp16's max: room for
# one growth of S (x2) and for batches whose peak is up to 8x the largest one seen.
_TARGET = 65504.0 * 2.0**-4


class LayerLossScale(LayerEdgeHooks, DynamicLossScale):
    """The dynamic scale S plus one factor per layer (see the module docstring).

    ``factors`` (L,) fp32 are the layers' r, ``layer_clean`` (L,) int32 their clean steps toward the
    next decision, ``layer_peak`` (L,) fp32 their largest |gradient| in true units since the last one;
    all three are in ``state_dict()`` with S's state. ``max_factor`` caps r (1 pins every layer at the
    global scale). The engine calls ``attach`` once, ``unscale_layers`` in each step; no host sync.
    """

    def __init__(self, config: LossScaleConfig | None = None, device: torch.device | str = "cpu", *,
                 max_factor: float = MAX_FACTOR) -> None:
        config = config or LossScaleConfig(kind=LossScaleKind.PER_LAYER)
        super().__init__(config, device)
        mantissa, _ = math.frexp(max_factor) if isinstance(max_factor, (int, float)) else (0, 0)
        if not (mantissa == 0.5 and 1 <= max_factor <= MAX_FACTOR):
            raise ValueError(f"max_factor must be a power of two in [1, 2**15] (so r and 1/r are exact in "
                             f"fp16), got {max_factor!r}")
        self.max_factor = float(max_factor)
        # The layers' back-off: the config's, rounded down to a power of two so every r stays one.
        self._backoff = 2.0 ** (math.frexp(self.config.backoff)[1] - 1)
        self.layers: list[Layer] = []
        self._entries: list[tuple[torch.Tensor, int]] = []   # (tensor the optimizer steps, its layer)
        self._hooks: list[Any] = []
        self._layer_hooks: dict[int, list[Any]] = {}   # each layer's own, to unhook one it pins
        self.pinned: dict[str, str] = {}               # layers kept at S (factor 1): name -> why
        self._pinned_at: list[int] = []
        self._engine: MixedPrecision | None = None
        self._recording = True        # until the first step: graph marks for check_graph
        self._refused = ""             # check_graph's refusal, once it refused
        self._unchecked_said = False   # the warning that a compiled first forward left nothing to check
        self._enter: dict[tuple[Any, int], int] = {}
        self._leave: dict[Any, int] = {}
        self._names: dict[int, str] = {}         # id(parameter) -> its name, for messages
        self._layer_of: dict[int, int] = {}       # id(model parameter) -> its layer
        self._size(0)

    def _size(self, n: int) -> None:
        device = self.value.device
        self.factors = torch.ones(n, dtype=torch.float32, device=device)
        self.inverses = torch.ones(n, dtype=torch.float32, device=device)
        # One short of the interval: the first clean step a layer takes sets its factor.
        self.layer_clean = torch.full((n,), self.config.growth_interval - 1, dtype=torch.int32, device=device)
        self.layer_peak = torch.zeros(n, dtype=torch.float32, device=device)
        # The backward hooks keep their statistics in these, in place (a compiled graph allows no Python
        # side effects in a hook): the largest |gradient| entering each layer (at S; -1: it did not run)
        # and leaving it (at S*r). step() moves them into the _peak pair and resets them.
        self._in_acc = torch.full((n,), -1.0, device=device)
        self._out_acc = torch.zeros(n, device=device)
        self._in_peak = torch.full((n,), -1.0, device=device)
        self._out_peak = torch.zeros(n, device=device)
        self._step_inverses = torch.ones(n, device=device)     # 1/r where the layer ran, else 1
        # 0-d views: the hooks multiply by them and write into them; in-place updates show through.
        views = (lambda t: list(t.unbind()) if n else [])
        self._factor_of, self._inverse_of = views(self.factors), views(self.inverses)
        self._step_inverse_of = views(self._step_inverses)

    # ----------------------------------------------------------------- set-up
    def attach(self, engine: MixedPrecision) -> None:
        """Find ``engine.model``'s layers, hook them, and map the optimizer's tensors to them."""
        if self._engine is not None:
            raise RuntimeError("this LayerLossScale is attached to an engine already")
        self.layers = find_layers(engine.model)
        self._size(len(self.layers))
        layer_of = {id(p): i for i, layer in enumerate(self.layers) for p in layer.params}
        copies = dict(zip(map(id, engine.master.masters), engine.master.model_params)) if engine.master else {}
        for group in engine.optimizer.param_groups:
            for p in group["params"]:
                i = layer_of.get(id(copies.get(id(p), p)))
                if i is not None:
                    self._entries.append((p, i))
        self._entry_layers = torch.tensor([i for _, i in self._entries], device=self.value.device)
        self._names = {id(p): n for n, p in engine.model.named_parameters()}
        self._layer_of = layer_of
        for i, layer in enumerate(self.layers):
            own = self._layer_hooks.setdefault(i, [])
            for module in layer.modules:
                own.append(module.register_forward_pre_hook(functools.partial(self._wrap_inputs, i),
                                                            with_kwargs=True))
                own.append(module.register_forward_hook(functools.partial(self._hook_outputs, i),
                                                        with_kwargs=True))
            self._hooks.extend(own)
        self._engine = engine

    def remove_hooks(self) -> None:
        """Take the forward hooks off the model (the engine no longer scales per layer after this)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # --------------------------------------------------------------- the step
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; on the first backward after the layers were marked, ``check_graph`` first (a
        refusal stands: every later call raises it again)."""
        if self._enter and loss.grad_fn is not None:
            try:
                while True:
                    ran = set(self._enter.values())
                    try:
                        check_graph(loss.grad_fn, self._enter, self._leave,
                                    functools.partial(self._expected, ran), self._describe)
                        break
                    except OutputsFeedEachOther as exc:     # keep that layer at S, prove the rest again
                        self._pin(exc.layer)
            except ValueError as exc:
                self._refused = str(exc)
            finally:
                self._forget_graph()
        elif self._recording and self.layers and loss.grad_fn is not None and not self._unchecked_said:
            # No layer marked the graph: its forward ran compiled (a traced hook has no grad_fn to mark).
            self._unchecked_said = True
            warnings.warn("scale=per-layer could not check this model's autograd graph: the first forward "
                          "marked no layer (it ran under torch.compile, where the hooks cannot mark the graph), "
                          "so a layer whose gradient would mix S and S*r (a parameter used outside its module, "
                          "a router whose outputs feed each other) is neither kept at S nor refused. Run the "
                          "first step with the plain model (the check runs once, then compile), or use "
                          "scale=dynamic", UserWarning, stacklevel=4)
        if self._refused:
            raise ValueError(self._refused)
        return super().scale(loss)

    def _pin(self, i: int) -> None:
        """Keep layer ``i`` at the global scale S for good: its factor 1 (the hooks already in this graph
        read it in place, so they multiply by 1 in this very backward, which has not run yet), its marks
        out of the graph being proved, its hooks off the model. Its weights then train exactly as under
        scale=dynamic; the other layers keep their factors."""
        name = self.layers[i].name
        self.factors[i] = 1.0
        self.inverses[i] = 1.0
        self._enter = {k: v for k, v in self._enter.items() if v != i}
        self._leave = {k: v for k, v in self._leave.items() if v != i}
        for handle in self._layer_hooks.pop(i, []):
            handle.remove()
        self._pinned_at.append(i)
        self._pin_mask = torch.zeros_like(self.factors, dtype=torch.bool)
        self._pin_mask[self._pinned_at] = True
        self.pinned[name] = ("it uses a tensor it returns inside its own forward to make another of its "
                             "outputs (a router's logits and the top-k weights made from them)")
        warnings.warn(f"scale=per-layer keeps layer {name!r} at the global scale (factor 1, as scale=dynamic): "
                      f"{self.pinned[name]}, so part of that tensor's gradient would be scaled twice; "
                      "every other layer keeps its own factor (mp.loss_scale.pinned lists these)",
                      UserWarning, stacklevel=4)

    def _forget_graph(self) -> None:
        self._recording = False
        self._enter, self._leave = {}, {}

    def _expected(self, ran: set[int], variable: torch.Tensor) -> tuple[int, ...] | None:
        """The marks a parameter's gradient must carry: its layer's, if that layer ran; None: not ours."""
        i = self._layer_of.get(id(variable))
        if i is None:
            return () if id(variable) in self._names else None
        return (i,) if i in ran else ()

    def _describe(self, marks: tuple[int, ...], variable: torch.Tensor | None) -> str:
        where = (" inside ".join(f"layer {self.layers[i].name!r}" for i in reversed(marks))
                 if marks else "outside every layer")
        if variable is None:
            return where
        return f"parameter {self._names.get(id(variable), '?')!r} gets its gradient {where}"

    def unscale_layers(self) -> None:
        """Gather the step's statistics and divide each layer's fp32 gradients by its factor, so every
        gradient the optimizer holds carries S alone. The engine calls it before the norm. No sync."""
        engine = self._engine
        if engine is None:
            raise RuntimeError("LayerLossScale.unscale_layers() needs attach(engine) first")
        if engine.grad_sync.kind is not SyncKind.LOCAL:
            raise ValueError("scale=per-layer runs in one process for now (every rank would need the same "
                             "factors); under DDP or FSDP use scale=dynamic")
        self._forget_graph()          # graphs of later steps are not held or checked
        if not self.layers:
            return
        self._in_peak.copy_(self._in_acc)
        self._out_peak.copy_(self._out_acc)
        self._in_acc.fill_(-1.0)
        self._out_acc.zero_()
        # A layer whose hooks did not run this step has its gradients at S (or none): divided by 1.
        self._step_inverses.copy_(torch.where(self._in_peak < 0, 1.0, self.inverses))
        entries = [(p.grad, i) for p, i in self._entries if p.grad is not None]
        if entries:
            grads = [g for g, _ in entries]
            if any(g.is_sparse for g in grads):
                raise ValueError("scale=per-layer needs dense gradients; build nn.Embedding with "
                                 "sparse=False, or use scale=dynamic")
            peaks = torch.stack(torch._foreach_norm(grads, math.inf)).float()   # inf/NaN kept
            index = self._entry_layers if len(entries) == len(self._entries) else \
                torch.tensor([i for _, i in entries], device=peaks.device)     # some weights got no gradient
            self._out_peak.scatter_reduce_(0, index, peaks, "amax")
            # fp32 gradients (fp32 weights, or the master's copies): dividing by 2**k is exact.
            torch._foreach_mul_(grads, [self._step_inverse_of[i] for _, i in entries])
        # The gradient that entered at S went on at S*r inside the layer: part of its own range.
        torch.maximum(self._out_peak, self._in_peak * self.factors, out=self._out_peak)

    def update(self, found_inf: torch.Tensor, skipped: bool | None = None) -> None:
        """S's update, with the overflows a layer's factor pays for taken out of it, then the layers'.
        Device ops only: no host sync (the compiled step traces it)."""
        if not self.layers:
            super().update(found_inf, skipped)
            return
        factors = self.factors
        ran = ~(self._in_peak < 0)                          # NaN counts as ran
        own = ran & (self._in_peak < math.inf) & ~(self._out_peak < math.inf)   # began inside the layer
        can_pay = factors > 1.0
        pays = found_inf & own & can_pay
        # S is spared only when some layer pays and no layer at r = 1 overflowed on its own as well.
        explained = pays.any() & ~(own & ~can_pay).any()
        scale_before = self.value.clone()
        super().update(found_inf & ~explained)
        self.skipped += explained            # skipped all the same: S's count missed these
        clean = ran & ~found_inf
        true_peak = self._out_peak / (scale_before * factors)    # exact: powers of two
        peak = torch.where(clean, torch.maximum(self.layer_peak, true_peak), self.layer_peak)
        count = torch.where(clean, self.layer_clean + 1, self.layer_clean)
        due = clean & (count >= self.config.growth_interval)
        # The largest power of two r with peak * S * r <= _TARGET; a layer with no gradient gets the cap.
        room = (_TARGET / (peak * self.value)).clamp(max=2.0 * self.max_factor)
        target = _pow2_floor(room).clamp(1.0, self.max_factor)
        new = torch.where(due, target, factors)
        new = torch.where(pays, (factors * self._backoff).clamp(min=1.0), new)
        if self._pinned_at:                  # their hooks ran in the backward that pinned them, not since
            new = torch.where(self._pin_mask, 1.0, new)
        reset = due | pays
        self.layer_clean.copy_(torch.where(reset, 0, count))
        self.layer_peak.copy_(torch.where(reset, 0.0, peak))
        factors.copy_(new)
        torch.reciprocal(factors, out=self.inverses)         # exact: powers of two

    def layer_factors(self) -> dict[str, float]:
        """Each layer's factor r by name. Syncs with the host."""
        return dict(zip((layer.name for layer in self.layers), self.factors.tolist()))

    # ---------------------------------------------------------------- state
    def _tensors(self) -> dict[str, torch.Tensor]:
        return super()._tensors() | {"layer_factors": self.factors, "layer_clean": self.layer_clean,
                                     "layer_peak": self.layer_peak}

    def check_state(self, state: dict[str, Any]) -> None:
        """ValueError unless ``state``'s layer part fits: one entry per layer, factors powers of two in
        [1, max_factor], peaks finite and >= 0, counts in [0, growth_interval). Syncs with the host."""
        n = len(self.layers)
        for key, dtype in (("layer_factors", torch.float32), ("layer_clean", torch.int32),
                           ("layer_peak", torch.float32)):
            value = state.get(key)
            if not (isinstance(value, torch.Tensor) and value.shape == (n,) and value.dtype == dtype):
                got = f"shape {tuple(value.shape)}, {value.dtype}" if isinstance(value, torch.Tensor) else value
                raise ValueError(f"loss scale state {key!r} is {got}, this model's per-layer scale needs {n} "
                                 f"{dtype} values (one per layer): build the model as it was when it was saved")
        factors, clean, peak = (state[k].cpu() for k in ("layer_factors", "layer_clean", "layer_peak"))
        interval = self.config.growth_interval
        for key, value, ok, rule in (
                ("layer_factors", factors, (torch.frexp(factors).mantissa == 0.5) & (factors >= 1)
                 & (factors <= self.max_factor), f"powers of two in [1, {self.max_factor:g}]"),
                ("layer_clean", clean, (clean >= 0) & (clean < interval), f"in [0, growth_interval={interval})"),
                ("layer_peak", peak, torch.isfinite(peak) & (peak >= 0), "finite and >= 0")):
            if not bool(ok.all()):
                raise ValueError(f"loss scale state {key!r} holds {value.tolist()}, not all {rule}: was the "
                                 "file edited?")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        super().load_state_dict(state)
        torch.reciprocal(self.factors, out=self.inverses)


def _pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= x, for finite x > 0 (exact: frexp and ldexp move exponents only)."""
    _, exponent = torch.frexp(x)
    return torch.ldexp(torch.full_like(x, 0.5), exponent)
