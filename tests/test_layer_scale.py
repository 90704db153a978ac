"""Per-layer loss scaling (mixprec.loss_scale.per_layer): the underflow it fixes, measured against fp32; overflows
skip and back off the right knob; pinned factors give the global dynamic scale bit for bit; any graph
(residuals, in-place ops, tied weights, reuse) gets exact gradients; checkpoints resume bit for bit."""

import copy
import re

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.loss_scale.layer_graph import find_layers
from mixprec.loss_scale.per_layer import MAX_FACTOR, LayerLossScale
from mixprec.recipe import LossScaleConfig, LossScaleKind, parse_recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TwoBranch(nn.Module):
    """``64 * big(x) + 1e-6 * small(1e-4 * x)``: ``big`` has the largest gradients and holds S near 2**6;
    ``small``'s weight gradients are ~1e-9 (its incoming gradient ~1e-6 times its inputs ~1e-4), below
    fp16's subnormals (2**-24 = 6e-8) at that S. ``spike_*`` multiply a branch's input: planted overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 4)
        self.small = nn.Linear(16, 4)
        self.spike_big = self.spike_small = 1.0

    def forward(self, x):                                  # (B, 16) -> (B, 4)
        return self.big(x * self.spike_big) * 64.0 + self.small(x * (1e-4 * self.spike_small)) * 1e-6


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)


def _two_branch_engine(recipe, opt=None, seed=0):
    torch.manual_seed(seed)
    model = TwoBranch()
    opt = opt or (lambda p: torch.optim.SGD(p, lr=0.0))      # lr 0: every step sees the same weights
    return MixedPrecision(model, opt(model.parameters()), recipe)


def _step(mp, x, y):
    with mp.autocast():
        loss = (mp.model(x) - y).square().mean()
    mp.backward(loss)
    result = mp.step()
    return result


class GradsAtStep:
    """A step observer: the gradients the optimizer is about to step on, divided by S (true units),
    keyed by the model's parameter (the fp32 copy's gradient under a master)."""

    def before_step(self, engine):
        copies = dict(zip(map(id, engine.master.masters), engine.master.model_params)) if engine.master else {}
        self.grads = {id(copies.get(id(p), p)): p.grad.double() / float(engine.loss_scale.value)
                      for g in engine.optimizer.param_groups for p in g["params"]}

    def after_step(self, engine, found_inf):
        pass


# ------------------------------------------------------------------------------ the grammar
@pytest.mark.parametrize("text", ["per-layer", "per-layer(growth_interval=100)",
                                  "per-layer(init=1024,backoff=0.25,hysteresis=2)"])
def test_scale_words_round_trip(text):
    config = LossScaleConfig.parse(text)
    assert config.kind is LossScaleKind.PER_LAYER
    assert str(config) == text and LossScaleConfig.parse(str(config)) == config
    recipe = parse_recipe(f"fp16,scale={text}")
    assert recipe.loss_scale == config and parse_recipe(str(recipe)) == recipe
    assert str(recipe) == f"params=fp32,compute=fp16,master=none,scale={text}"


@pytest.mark.parametrize("text, message", [("per-layer(max=3)", "valid keys: init"),
                                           ("per-layers", "per-layer, per-layer(the same options)"),
                                           ("per-layer(backoff=2)", "backoff must be in (0, 1)")])
def test_bad_scale_words_say_what_is_valid(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LossScaleConfig.parse(text)


# ------------------------------------------------------------------------------- the layers
def test_layers_are_leaf_owners_with_tied_ones_merged():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.attn = nn.MultiheadAttention(8, 2)           # owns in_proj_weight and has out_proj
            self.norm = nn.LayerNorm(8)
            self.frozen = nn.Linear(8, 8).requires_grad_(False)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight
    layers = find_layers(Tied())
    assert [layer.name for layer in layers] == ["emb+head", "attn.out_proj", "norm"]
    assert len(layers[0].params) == 1 and len(layers[0].modules) == 2


def _hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()]


def test_off_installs_nothing_and_on_installs_two_hooks_per_layer_module():
    plain = _hook_counts(TwoBranch())
    dynamic = _hook_counts(_two_branch_engine("fp16,scale=dynamic").model)    # the recipe's own casts
    assert dynamic[1:] == plain[1:] == [(0, 0, 0), (0, 0, 0)]                # nothing on the layers
    per_layer = _two_branch_engine("fp16,scale=per-layer")
    assert isinstance(per_layer.loss_scale, LayerLossScale)
    assert _hook_counts(per_layer.model) == [dynamic[0], (1, 1, 0), (1, 1, 0)]    # the root, big, small
    per_layer.loss_scale.remove_hooks()
    assert _hook_counts(per_layer.model) == dynamic


# ------------------------------------------------------------------------------ the underflow
@pytest.mark.parametrize("recipe", ["fp16", "fp16-pure"])
def test_per_layer_keeps_a_tiny_layer_out_of_fp16_underflow(recipe):
    # S is held at 2**6 by 'big' (growth_interval large: it never grows here). 'small's weight gradients
    # (~1e-9) times 64 fall below fp16's subnormals under the global scale; its own factor lifts them.
    x, y = _data()
    torch.manual_seed(0)
    ref = TwoBranch()
    (ref(x) - y).square().mean().backward()           # the fp32 reference gradients
    runs, seen = {}, {}
    for kind in ("dynamic", "per-layer"):
        mp = _two_branch_engine(f"{recipe},scale={kind}(init=64,growth_interval=1000)")
        assert not _step(mp, x, y).skipped             # the first clean step sets the factors
        mp.zero_grad()
        mp.add_step_observer(seen.setdefault(kind, GradsAtStep()))
        assert not _step(mp, x, y).skipped and mp.scale == 64
        runs[kind] = mp
    g_ref = ref.small.weight.grad.double()
    assert 1e-10 < g_ref.abs().max() < 2e-9            # the plant: products ~1e-9
    zeros, errors = {}, {}
    for kind, mp in runs.items():
        g = seen[kind].grads[id(mp.model.small.weight)]
        zeros[kind] = (g == 0).double().mean().item()
        errors[kind] = ((g - g_ref).norm() / g_ref.norm()).item()
    assert zeros["dynamic"] > 0.3 and errors["dynamic"] > 0.3          # measured: 50% zeros, 46% error
    assert zeros["per-layer"] == 0 and errors["per-layer"] < 2e-3      # measured: 0 zeros, 5e-4 error
    assert runs["per-layer"].loss_scale.layer_factors() == {"big": 1.0, "small": MAX_FACTOR}
    # 'big' keeps factor 1: its gradients are the global scale's, bit for bit.
    big = [seen[kind].grads[id(mp.model.big.weight)] for kind, mp in runs.items()]
    assert torch.equal(*big)


# ------------------------------------------------------------------------- overflow and skip
def _state(mp):
    return (copy.deepcopy(mp.model.state_dict()), copy.deepcopy(mp.optimizer.state_dict()),
            {k: v.clone() for k, v in mp.loss_scale.state_dict().items()})


def _same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a.values(), b.values())) and a.keys() == b.keys()


def test_an_overflow_inside_a_lifted_layer_skips_and_halves_that_layer_only():
    x, y = _data()
    mp = _two_branch_engine("fp16,scale=per-layer(init=64,growth_interval=1000)",
                            opt=lambda p: torch.optim.AdamW(p, lr=1e-3))
    for _ in range(2):
        assert not _step(mp, x, y).skipped
        mp.zero_grad()
    ls = mp.loss_scale
    assert ls.layer_factors() == {"big": 1.0, "small": 2.0**15}
    weights, opt_state, before = _state(mp)
    mp.model.spike_small = 1e8        # small's inputs ~1e4: its weight gradients at S*r = 2**21 overflow
    result = _step(mp, x, y)
    mp.zero_grad()
    assert result.skipped and result.scale == 64                     # skipped; S keeps its value...
    after = ls.state_dict()
    assert _same(mp.model.state_dict(), weights)                     # weights untouched
    assert _same(mp.optimizer.state_dict()["state"][0], opt_state["state"][0])
    assert ls.layer_factors() == {"big": 1.0, "small": 2.0**14}      # ...the layer that overflowed pays
    assert (int(after["steps"]), int(after["skipped"])) == (3, 1)
    assert int(after["clean_steps"]) == int(before["clean_steps"]) + 1    # not S's overflow
    assert after["layer_clean"].tolist() == [before["layer_clean"][0].item(), 0]
    # An overflow where no lifted layer explains it ('big' at r = 1) is S's: it backs off, factors stay.
    mp.model.spike_small, mp.model.spike_big = 1.0, 1e6
    result = _step(mp, x, y)
    mp.zero_grad()
    assert result.skipped and result.scale == 32
    assert ls.layer_factors() == {"big": 1.0, "small": 2.0**14}
    assert (int(ls.steps), int(ls.skipped), int(ls.clean_steps)) == (4, 2, 0)
    assert _same(mp.model.state_dict(), weights)


# --------------------------------------------------------- pinned factors: the global scale
class Residual(nn.Module):
    """A residual stream with a norm, an in-place ReLU after a linear and a branch that is summed back."""

    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.relu = nn.ReLU(inplace=True)
        self.out = nn.Linear(d, 4)

    def forward(self, x):                                  # (B, 8) -> (B, 4)
        h = self.inp(x)
        h = h + self.relu(self.fc(self.ln(h)))
        return self.out(h)


def _train_pinned(recipe, steps=8, boom=(3, 4)):
    torch.manual_seed(0)
    model = Residual()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    if isinstance(mp.loss_scale, LayerLossScale):
        mp.loss_scale.max_factor = 1.0        # every factor pinned at 1
    g = torch.Generator().manual_seed(2)
    trace = []
    for i in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
        with mp.autocast():
            loss = F.cross_entropy(model(x), y) * (1e4 if i in boom else 1.0)    # planted overflows
        mp.backward(loss)
        r = mp.step()
        mp.zero_grad()
        trace.append(repr(r))               # skipped, scale, grad norm (nan on a skip)
    state = {k: v for k, v in mp.loss_scale.state_dict().items() if not k.startswith("layer_")}
    return trace, [p.detach().clone() for p in model.parameters()], state


@pytest.mark.parametrize("base", ["fp16", "fp16-pure"])
def test_pinned_factors_train_as_the_global_dynamic_scale_bit_for_bit(base):
    options = "(init=2**12,growth_interval=2,hysteresis=2)"
    dynamic = _train_pinned(f"{base},scale=dynamic{options}")
    pinned = _train_pinned(f"{base},scale=per-layer{options}")
    assert dynamic[0] == pinned[0]                       # skips, scales and norms, step by step
    assert any("skipped=True" in r for r in dynamic[0])
    assert all(torch.equal(a, b) for a, b in zip(dynamic[1], pinned[1]))
    assert all(torch.equal(a, pinned[2][k]) for k, a in dynamic[2].items())


# ------------------------------------------------------------------ exact on any graph
class Zoo(nn.Module):
    """Tied embedding and head, a linear applied twice, a residual add, an in-place ReLU on a layer's
    output, a keyword input, a tuple output, and MultiheadAttention (whose out_proj is used functionally)."""

    def __init__(self, vocab=12, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.twice = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.gate = Gate(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):                                # (B, T) -> (B, T, vocab)
        h = self.emb(idx)
        h = h + F.relu_(self.twice(self.twice(h)))
        a, _ = self.attn(h, h, h, need_weights=False)
        h, extra = self.gate(self.ln(h + a), scale=h)
        return self.head(h + extra)


class Gate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x, *, scale):
        return x * self.w, scale * self.w.mean()


def _zoo_grads(recipe, factors=None):
    torch.manual_seed(0)
    model = Zoo()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
    if factors is not None:
        mp.loss_scale.factors.copy_(torch.tensor(factors))
        torch.reciprocal(mp.loss_scale.factors, out=mp.loss_scale.inverses)
    idx = torch.randint(0, 12, (3, 5), generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    mp.backward(loss)                     # the first backward: check_graph walks it
    mp.step()
    return mp, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_any_factors_give_the_global_scales_gradients_exactly():
    # In fp32 a power of two scales every product and sum exactly, so whatever each layer's factor, the
    # unscaled gradients must be the global scale's bit for bit: a missed or doubled hook would show.
    _, reference = _zoo_grads("params=fp32,compute=fp32,scale=dynamic")
    mp, _ = _zoo_grads("params=fp32,compute=fp32,scale=per-layer")
    names = [layer.name for layer in mp.loss_scale.layers]
    assert names == ["emb+head", "twice", "ln", "attn.out_proj", "gate"]
    _, grads = _zoo_grads("params=fp32,compute=fp32,scale=per-layer", factors=[2.0**15, 8.0, 2.0**9, 64.0, 2.0])
    assert grads.keys() == reference.keys()
    assert all(torch.equal(grads[k], reference[k]) for k in reference), \
        [k for k in reference if not torch.equal(grads[k], reference[k])]


def test_a_parameter_used_outside_its_module_is_refused_at_the_first_backward():
    class FunctionalHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)

        def forward(self, idx):
            return F.linear(self.mid(self.emb(idx)), self.emb.weight)   # the tie, done by hand

    model = FunctionalHead()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16,scale=per-layer")
    with mp.autocast():
        loss = model(torch.arange(4)).logsumexp(-1).mean()
    with pytest.raises(ValueError, match="'emb.weight'.*scale=dynamic"):
        mp.backward(loss)
    with mp.autocast():
        loss = model(torch.arange(4)).logsumexp(-1).mean()
    with pytest.raises(ValueError, match="'emb.weight'"):      # the refusal stands
        mp.backward(loss)
    assert all(p.grad is None for p in model.parameters())


def test_a_tensor_escaping_a_layer_is_refused():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)
            return self.b(y) + self.a.weight.sum()      # a's weight feeds the output outside a's forward

    model = Leaky()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16,scale=per-layer")
    with mp.autocast():
        loss = model(torch.randn(2, 4)).sum()
    with pytest.raises(ValueError, match="cannot scale this model"):
        mp.backward(loss)


# ----------------------------------------------------------------------------- checkpoints
def _run(mp, n, x, y):
    for _ in range(n):
        _step(mp, x, y)
        mp.zero_grad()


def test_checkpoint_resumes_bit_for_bit(tmp_path):
    x, y = _data()
    recipe = "fp16,scale=per-layer(init=256,growth_interval=3)"
    adamw = (lambda p: torch.optim.AdamW(p, lr=1e-3))
    whole = _two_branch_engine(recipe, opt=adamw)
    _run(whole, 4, x, y)
    save_checkpoint(tmp_path / "ck.pt", whole)
    _run(whole, 4, x, y)
    resumed = _two_branch_engine(recipe, opt=adamw, seed=7)      # other weights until the load
    load_checkpoint(tmp_path / "ck.pt", resumed)
    _run(resumed, 4, x, y)
    assert _same(whole.model.state_dict(), resumed.model.state_dict())
    a, b = whole.loss_scale.state_dict(), resumed.loss_scale.state_dict()
    assert _same(a, b) and a["layer_factors"].tolist()[1] > 1      # the lifted factor came along


@pytest.mark.parametrize("key, value, message", [
    ("layer_factors", torch.tensor([1.0, 3.0]), "powers of two"),
    ("layer_factors", torch.tensor([1.0, 2.0**16]), "powers of two in [1, 32768]"),
    ("layer_factors", torch.tensor([1.0]), "one per layer"),
    ("layer_peak", torch.tensor([0.0, -1.0]), "finite and >= 0"),
    ("layer_clean", torch.tensor([0, 5], dtype=torch.int32), "growth_interval=3"),
])
def test_a_damaged_layer_state_is_refused_and_changes_nothing(key, value, message):
    x, y = _data()
    mp = _two_branch_engine("fp16,scale=per-layer(init=256,growth_interval=3)")
    _run(mp, 2, x, y)
    state = mp.state_dict()
    before = {k: v.clone() for k, v in state["loss_scale"].items()}
    state["loss_scale"][key] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        mp.load_state_dict(state)
    assert _same(mp.loss_scale.state_dict(), before)


# --------------------------------------------------------------------------------- refusals
def test_sparse_gradients_are_refused_at_the_step():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp16,scale=per-layer")
    with mp.autocast():
        loss = model(torch.arange(3)).sum()
    mp.backward(loss)
    with pytest.raises(ValueError, match="dense gradients"):
        mp.step()


# ------------------------------------------------------------------------------ torch.compile
@pytest.mark.slow
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14),
                    reason="torch 2.15's dynamo refuses the layer hooks' peak record (input mutation in "
                           "register_hook); docs/step.md says so: compile the step, not the model, there")
def test_a_compiled_model_scales_per_layer_as_eager_does():
    x, y = _data()
    results = []
    for compiled in (False, True):
        mp = _two_branch_engine("fp16,scale=per-layer(init=64,growth_interval=1000)")
        forward = torch.compile(mp.model, backend="aot_eager", fullgraph=True) if compiled else mp.model
        for i in range(2):
            with mp.autocast():
                loss = (forward(x) - y).square().mean()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                mp.backward(loss)
            # The compiled first forward marks no layer: the graph check cannot run, and says so once.
            unchecked = [w for w in said if "could not check this model's autograd graph" in str(w.message)]
            assert len(unchecked) == (compiled and i == 0)
            mp.step()
            grad = mp.model.small.weight.grad.clone()
            mp.zero_grad()
        results.append((mp.loss_scale.state_dict(), grad))
    (eager_state, eager_grad), (compiled_state, compiled_grad) = results
    assert _same(eager_state, compiled_state) and eager_state["layer_factors"].tolist() == [1.0, 2.0**15]
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-3, atol=0)


@pytest.mark.slow
def test_the_compiled_step_updates_the_layer_factors_in_its_graph():
    # compile_step() traces LayerLossScale.update into the step's graph: the same factors and S as eager.
    x, y = _data()
    states = []
    for compiled in (False, True):
        mp = _two_branch_engine("fp16,scale=per-layer(init=64,growth_interval=1000)",
                                opt=lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
        if compiled:
            mp.compile_step(backend="aot_eager")
        for spike in (1.0, 1.0, 1e8, 1.0):                 # the third step overflows inside 'small'
            mp.model.spike_small = spike
            _step(mp, x, y)
            mp.zero_grad(set_to_none=False)
        states.append((mp.loss_scale.state_dict(), mp.model.state_dict()))
    assert _same(states[0][0], states[1][0]) and states[0][0]["layer_factors"].tolist() == [1.0, 2.0**14]
    assert int(states[0][0]["skipped"]) == 1
    for a, b in zip(states[0][1].values(), states[1][1].values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


# ------------------------------------------------ tuple outputs, nested tuples, a Mixtral-style router
class Pair(nn.Module):
    """Returns ((a, b), c): three slices of one product, each used by the parent."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 3 * d * d).reshape(3 * d, d))

    def forward(self, x):
        a, b, c = F.linear(x, self.w).chunk(3, -1)
        return (a, b), c


class Router(nn.Module):
    """HF Mixtral's MixtralTopKRouter: returns its logits and the top-k weights made from them (in place)."""

    def __init__(self, d, experts=4, k=2):
        super().__init__()
        self.k = k
        self.weight = nn.Parameter(torch.randn(experts, d) * 0.5)

    def forward(self, h):
        logits = F.linear(h, self.weight)
        top, index = torch.topk(F.softmax(logits.float(), dim=-1), self.k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, index


class Routed(nn.Module):
    """A tuple-returning layer and a sparse MoE block (router, top-k, experts); ``aux``: the router's
    logits also feed a load-balancing loss in the parent (HF's output_router_logits)."""

    def __init__(self, d=8, aux=True):
        super().__init__()
        self.aux = aux
        self.pair = Pair(d)
        self.gate = Router(d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, 3)

    def forward(self, x):                                   # (B, d) -> (logits (B, 3), aux loss)
        (a, b), c = self.pair(x)
        h = a * torch.sigmoid(b) + c
        logits, top, index = self.gate(h)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(index == e)
            out = out.index_add(0, rows, expert(h[rows]) * top[rows, slot, None])
        aux = logits.softmax(-1).mean(0).square().sum() if self.aux else h.new_zeros(())
        return self.head(out + h), aux


def _routed_grads(recipe, aux, factors=None, steps=2):
    torch.manual_seed(0)
    model = Routed(aux=aux)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.05), recipe)
    if factors is not None:
        mp.loss_scale.factors.copy_(torch.tensor(factors))
        torch.reciprocal(mp.loss_scale.factors, out=mp.loss_scale.inverses)
    g = torch.Generator().manual_seed(3)
    grads = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        with mp.autocast():
            logits, aux = model(x)
            loss = F.cross_entropy(logits, y) + 0.1 * aux
        mp.backward(loss)
        mp.step()                           # unscales the gradients in place (fp32 weights), then steps
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()} | {"loss": loss.detach()})
        mp.zero_grad()
    return mp, grads


@pytest.mark.parametrize("aux", [True, False], ids=["logits-used-by-parent", "logits-used-inside-only"])
def test_tuple_outputs_and_a_mixtral_router_train_as_the_global_scale_exactly(aux):
    # fp32 compute: powers of two scale exactly, so whatever the factors the gradients must be
    # scale=dynamic's bit for bit. The router feeds its own top-k weights from its logits: no factor but
    # 1 is exact there, so it is kept at S (pinned, with a warning naming it); the others keep theirs.
    _, reference = _routed_grads("params=fp32,compute=fp32,scale=dynamic", aux)
    with pytest.warns(UserWarning, match=r"keeps layer 'gate' at the global scale"):
        mp, grads = _routed_grads("params=fp32,compute=fp32,scale=per-layer", aux,
                                  factors=[2.0**15, 2.0**9, 8.0, 64.0, 2.0, 4.0, 2.0**12])
    names = [layer.name for layer in mp.loss_scale.layers]
    assert names == ["pair", "gate", "experts.0", "experts.1", "experts.2", "experts.3", "head"]
    assert list(mp.loss_scale.pinned) == ["gate"]
    assert mp.loss_scale.layer_factors()["gate"] == 1.0     # the first step's update left it pinned
    for step, (got, want) in enumerate(zip(grads, reference)):
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], step
    assert sum(1 for h in mp.loss_scale._hooks if h.id in model_hook_ids(mp.model)) == 2 * (len(names) - 1)


def model_hook_ids(model):
    return {hid for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for hid in d}
