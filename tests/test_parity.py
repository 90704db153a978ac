"""A drop-in first: by default ``fp16`` and ``bf16`` train bit for bit like the hand-written torch.amp
loop they replace, dispatch at most a few aten ops more per step (the non-finite skip: one fused
reduction), and add no compiled graph and no node. Counted, not timed (benchmarks/step/bench_parity.py times)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from mixprec import MixedPrecision
from mixprec.diagnostics.op_count import count_aten_ops, count_compiled_graphs
from mixprec.lab.models import GPT, GPTConfig
from mixprec.casting.saved16 import SavedPolicyWarning

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# The non-finite skip (3 ops of norm, 2 of flag), counting steps and skips (2), and where the step
# cannot skip on the device, the host's read of the flag (1).
EXTRA_OPS = 8


def small_gpt(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
            for _ in range(n)]


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class AmpLoop:
    """The loop mixprec replaces: torch.autocast, and for fp16 a GradScaler."""

    def __init__(self, model, opt, recipe):
        self.model, self.opt, self.dtype = model, opt, DTYPES[recipe]
        self.scaler = torch.amp.GradScaler("cpu", enabled=self.dtype == torch.float16)

    def step(self, x, y):
        with torch.autocast("cpu", dtype=self.dtype):
            loss = loss_of(self.model, x, y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        return loss


class MixprecLoop:
    def __init__(self, model, opt, recipe):
        self.model = model
        with warnings.catch_warnings():
            warnings.simplefilter("error")        # the default recipes build without a notice
            self.mp = MixedPrecision(model, opt, recipe)

    def step(self, x, y):
        with self.mp.autocast():
            loss = loss_of(self.model, x, y)
        self.mp.backward(loss)
        self.mp.step()
        self.mp.zero_grad()
        return loss


def pair(recipe, fused, n_layer=2):
    loops = []
    for cls in (AmpLoop, MixprecLoop):
        model = small_gpt(n_layer)
        loops.append(cls(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused,
                                                  foreach=None if fused else True), recipe))
    return loops


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_default_recipes_train_bit_for_bit_like_torch_amp(recipe, fused):
    amp, mixed = pair(recipe, fused)
    start = [p.detach().clone() for p in amp.model.parameters()]
    for x, y in make_batches(5):
        assert torch.equal(amp.step(x, y), mixed.step(x, y))          # the same loss at every step
    for (name, a), b, s in zip(amp.model.named_parameters(), mixed.model.parameters(), start):
        assert torch.equal(a, b), name
        assert not torch.equal(a, s), f"{name} did not move: the comparison would prove nothing"
    if recipe == "fp16":
        assert mixed.mp.scale == amp.scaler.get_scale()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_an_eager_step_dispatches_at_most_a_few_ops_more_than_torch_amp(recipe, fused):
    amp, mixed = pair(recipe, fused)
    batches = make_batches(3)
    for loop in (amp, mixed):
        for x, y in batches[:2]:        # warm-up: optimizer state exists, first-step paths are done
            loop.step(x, y)
    x, y = batches[2]
    ops_amp = count_aten_ops(lambda: amp.step(x, y))
    ops_mixprec = count_aten_ops(lambda: mixed.step(x, y))
    print(f"{recipe} {'fused' if fused else 'foreach'}: torch.amp {ops_amp.total} aten ops, "
          f"mixprec {ops_mixprec.total}: {ops_mixprec.minus(ops_amp)}")
    assert ops_mixprec.total <= ops_amp.total + EXTRA_OPS, ops_mixprec.minus(ops_amp)
    # No cast, copy or per-tensor work of ours: the forward and backward are torch.amp's, and the
    # step reads the gradients with one multi-tensor op (the loss scale's clone is StepResult's).
    for name in ("_to_copy", "copy_", "detach", "view", "dot", "reshape"):
        assert ops_mixprec.by_name.get(name, 0) <= ops_amp.by_name.get(name, 0), name


def test_a_step_with_inf_is_still_skipped_by_default_under_bf16():
    _, mixed = pair("bf16", fused=False)
    x, y = make_batches(1)[0]
    with mixed.mp.autocast():
        loss = loss_of(mixed.model, x, y)
    mixed.mp.backward(loss)
    before = [p.detach().clone() for p in mixed.model.parameters()]
    next(mixed.model.parameters()).grad[0, 0] = float("inf")
    assert mixed.mp.step().skipped
    assert all(torch.equal(a, b) for a, b in zip(before, mixed.model.parameters()))


def _compiled_graphs(loop):
    torch._dynamo.reset()
    # As users compile: the module, so the hooks mixprec installs on it are compiled with it.
    loop.model = torch.compile(loop.model)
    with count_compiled_graphs() as graphs:
        loop.step(*make_batches(1)[0])
    return graphs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_a_compiled_model_has_torch_amps_graphs_and_nodes(recipe):
    amp, mixed = pair(recipe, fused=False, n_layer=1)
    ref, ours = _compiled_graphs(amp), _compiled_graphs(mixed)
    print(f"{recipe}: torch.amp {ref.graphs} graphs {ref.nodes}, mixprec {ours.graphs} graphs {ours.nodes}")
    assert ref.graphs == 2                       # a forward and a backward: the count is seen
    assert ours.graphs <= ref.graphs and ours.total_nodes <= ref.total_nodes


@pytest.mark.parametrize("recipe", ["bf16", "fp16", "bf16,saved=low", "bf16-pure", "bf16-sr", "fp8-delayed"])
def test_mp_autocast_inside_a_compiled_function_does_not_break_the_graph(recipe):
    model = small_gpt(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), recipe)

    def forward(x, y):
        with mp.autocast():
            return loss_of(model, x, y)

    explained = torch._dynamo.explain(forward)(*make_batches(1)[0])
    assert explained.graph_break_count == 0, explained.break_reasons


def test_saved_policy_says_once_that_it_stops_at_a_compiled_region():
    model = small_gpt(1)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16,saved=low")
    compiled = torch.compile(model, backend="aot_eager")   # AOTAutograd makes the region; no Inductor
    batches = make_batches(2)
    with pytest.warns(SavedPolicyWarning, match="saved=low applies to the eager parts"):
        with mp.autocast():
            loss = loss_of(compiled, *batches[0])
        mp.backward(loss)
    mp.step()
    mp.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SavedPolicyWarning)     # once, not every step
        with mp.autocast():
            loss = loss_of(compiled, *batches[1])
        mp.backward(loss)
    # An eager model under the same policy hears nothing.
    eager = small_gpt(1)
    mp = MixedPrecision(eager, torch.optim.AdamW(eager.parameters()), "bf16,saved=low")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SavedPolicyWarning)
        with mp.autocast():
            loss = loss_of(eager, *batches[0])
        mp.backward(loss)


class ClippedAmpLoop(AmpLoop):
    """torch's documented clipping under a GradScaler: unscale_, clip_grad_norm_, step."""

    def __init__(self, model, opt, recipe, clip):
        super().__init__(model, opt, recipe)
        self.clip = clip

    def step(self, x, y):
        with torch.autocast("cpu", dtype=self.dtype):
            loss = loss_of(self.model, x, y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        return loss


@pytest.mark.parametrize("recipe, opt", [("fp16", "fused"), ("fp16", "sgd"), ("bf16", "foreach")])
def test_a_binding_clip_trains_bit_for_bit_like_unscale_clip_step(recipe, opt):
    # Issue 33: with the clip binding, mixprec divided by S / clip inside the kernel where torch
    # multiplies the unscaled gradients by clip: 4.2e-5 apart in the weights after 40 steps.
    def make(model):
        if opt == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=opt == "fused",
                                 foreach=None if opt == "fused" else True)
    clip = 0.05                  # the norm is ~1-4 here: the clip binds at every step
    model = small_gpt()
    amp = ClippedAmpLoop(model, make(model), recipe, clip)
    model = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp = MixedPrecision(model, make(model), recipe, clip_grad_norm=clip)
    for x, y in make_batches(6):
        assert torch.equal(amp.step(x, y), loss := _mp_step(mp, x, y)), loss
        norm = mp._last_norm
        assert norm > clip          # bound
    for (name, a), b in zip(amp.model.named_parameters(), mp.model.parameters()):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())


def _mp_step(mp, x, y):
    with mp.autocast():
        loss = loss_of(mp.model, x, y)
    mp.backward(loss)
    mp._last_norm = float(mp.step().grad_norm)
    mp.zero_grad()
    return loss
