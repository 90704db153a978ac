"""Saved activations in 16 bits: exact upcasts stored in their source dtype change nothing bit for bit;
saved=low rounds the rest to bf16 with a small, measured gradient error, but never a softmax output
nor anything in a region the recipe keeps fp32; the meter sees the result. The default is saved=fp32:
nothing is packed, as under torch.autocast."""

import pytest
import torch
import torch.nn.functional as F

from mixprec import MixedPrecision, cross_entropy, memory_report, parse_recipe
from mixprec.diagnostics.memory import SavedTensorMeter
from mixprec.lab.models import GPT, GPTConfig
from mixprec.casting.saved16 import Saved, SavedPacker, _upcast_source, upcast_source


def test_only_casts_up_from_16_bits_are_exact():
    a = torch.randn(8, requires_grad=True)
    assert _upcast_source((a.to(torch.bfloat16) * 2).float()) == torch.bfloat16
    assert _upcast_source((a.half() * 2).to(torch.float32)) == torch.float16
    assert _upcast_source(a.double().float()) is None          # fp64 -> fp32 rounds: not exact
    assert _upcast_source(a.exp()) is None                     # computed in fp32
    assert _upcast_source(a.to(torch.bfloat16).float()[:4]) is None   # the packer leaves views alone ...
    assert upcast_source(a.to(torch.bfloat16).float().reshape(2, 4)[:1].t()) == torch.bfloat16  # ... values are 16-bit
    assert upcast_source(a.to(torch.bfloat16).float().exp()[:4]) is None


def test_packed_saves_are_counted_as_16_bit_by_an_outer_meter():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensorMeter() as meter, SavedPacker(Saved.EXACT):
        h = (x.to(torch.bfloat16) @ w).float()        # an fp32 copy of a bf16 matmul output ...
        y = F.layer_norm(h, (32,))                    # ... saved by the fp32 layer norm
    # mm saves its bf16 inputs: the cast of the leaf x (64x32 x 2 B) and the leaf w itself (32x32 x 2 B,
    # no meter exclusion here); layer_norm its input, now as the bf16 copy (64x32 x 2 B instead of 4),
    # and its fp32 mean and rstd (64 each, 4 B).
    assert meter.groups == {("cast of a weight", "bfloat16"): 64 * 32 * 2, ("no grad_fn", "bfloat16"): 32 * 32 * 2,
                            ("cast", "bfloat16"): 64 * 32 * 2, ("no grad_fn", "float32"): 2 * 64 * 4}
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))


def train_gpt(recipe, steps=3):
    model = gpt()
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (4, 16), generator=g)
        with mp.autocast():
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        mp.backward(loss)
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
        mp.step()
        mp.zero_grad()
    return model, grads


@pytest.mark.parametrize("recipe", ["bf16-pure", "fp16-pure", "bf16"])
def test_exact_packing_trains_bit_for_bit_like_fp32_saves(recipe):
    packed, _ = train_gpt(recipe + ",saved=exact")
    plain, _ = train_gpt(recipe + ",saved=fp32")
    for a, b in zip(packed.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["bf16-pure", "fp16-pure"])
def test_pure_recipes_have_nothing_to_round_so_low_is_exact(recipe):
    # A pure recipe's residual stream is already 16-bit and its norms run in fp32 regions: rounding
    # "the rest" finds nothing beyond the exact upcasts.
    default, _ = train_gpt(recipe + ",saved=low")
    exact, _ = train_gpt(recipe + ",saved=exact")
    for a, b in zip(default.state_dict().values(), exact.state_dict().values()):
        assert torch.equal(a, b)


def test_saved_low_rounds_fp32_activations_with_a_small_gradient_error():
    assert parse_recipe("bf16").saved is Saved.FP32 and parse_recipe("bf16-pure").saved is Saved.FP32
    _, low = train_gpt("bf16,saved=low", steps=1)
    _, plain = train_gpt("bf16,saved=exact", steps=1)
    _, ref = train_gpt("fp32", steps=1)
    # Rounding the residual stream to bf16 for the backward moves the gradient by less than bf16
    # compute itself already does against fp32.
    bf16_error = (plain[0] - ref[0]).norm() / ref[0].norm()
    low_error = (low[0] - plain[0]).norm() / plain[0].norm()
    assert 0 < low_error < bf16_error


def test_low_keeps_softmax_outputs_and_fp32_regions_in_fp32():
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorMeter() as meter, torch.autocast("cpu", dtype=torch.bfloat16), SavedPacker(Saved.LOW):
        h = x * 3
        s = h.sin()                                 # sin saves its fp32 input, made under autocast: rounded
        p = torch.log_softmax(h, dim=-1)            # its output is kept fp32
        q = h.exp()                                 # exp saves its fp32 output: rounded
        with torch.autocast("cpu", enabled=False):  # an fp32 region: nothing rounded
            r = (x * 5).exp()
    assert meter.groups == {("Mul", "bfloat16"): 8 * 16 * 2, ("LogSoftmax", "float32"): 8 * 16 * 4,
                            ("Exp", "bfloat16"): 8 * 16 * 2, ("Exp", "float32"): 8 * 16 * 4}
    (s.sum() + p.sum() + q.sum() + r.sum()).backward()
    ref = torch.autograd.grad((x * 3).sin().sum() + torch.log_softmax(x * 3, -1).sum() + (x * 3).exp().sum()
                              + (x * 5).exp().sum(), x)[0]
    assert 0 < (x.grad - ref).norm() / ref.norm() < 2**-8      # bf16's half ulp, from the rounded saves


def test_gpt_saves_at_most_055_of_fp32s_activations_when_asked():
    # The gpt workload's shape (2 blocks, width 64, context 64, batch 32, 103 characters), on meta.
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=103, block_size=64, n_layer=2, n_head=4, n_embd=64))
    ids = torch.zeros(32, 64, dtype=torch.int64)
    loss = lambda out, t: cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    fp32 = memory_report(model, "fp32", (ids, ids), loss_fn=loss).predicted.activations
    ratios = {r: memory_report(model, r, (ids, ids), loss_fn=loss).predicted.activations / fp32
              for r in ["bf16", "bf16,saved=exact", "bf16,saved=low", "bf16-pure", "bf16-pure,saved=exact"]}
    assert ratios["bf16,saved=low"] <= 0.55 and ratios["bf16-pure,saved=exact"] <= 0.55
    # The default saves as autograd does; exact finds no upcast to pack under autocast here (its casts are
    # of fp32 weights down), low rounds the fp32 residual stream.
    assert ratios["bf16,saved=low"] < ratios["bf16,saved=exact"] <= ratios["bf16"]
    assert ratios["bf16-pure,saved=exact"] < ratios["bf16-pure"]


def test_saved_key_round_trips_and_names_the_fix():
    r = parse_recipe("bf16,saved=exact")
    assert r.saved is Saved.EXACT and parse_recipe(str(r)) == r and str(parse_recipe("bf16")) == str(r)[:-12]
    assert parse_recipe("bf16,saved=fp32") == parse_recipe("bf16")     # the default is not spelled out
    assert parse_recipe(str(parse_recipe("bf16,saved=low"))).saved is Saved.LOW
    with pytest.raises(ValueError, match="unknown saved 'half'; valid values: fp32, exact, low"):
        parse_recipe("bf16,saved=half")
