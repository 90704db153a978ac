"""Hugging Face models as users build them: rotary tables under pure recipes, GPT-2's Conv1D in fp8."""

import copy

import torch
from optional_deps import need

from mixprec import MixedPrecision
from mixprec.fp8 import Fp8Conv1D, Fp8Linear
from mixprec.recipe import Fp8Config

need("transformers")
import hf_tiny  # noqa: E402  (after the skip: it imports transformers lazily, but only makes sense with it)


def test_llama_rotary_tables_stay_exact_under_bf16_pure_at_long_positions():
    # head_dim 128 as in Llama: the 10 rad error at position 8191 comes from a bf16 inv_freq.
    model, make_batch, loss_of = hf_tiny.llama(head_dim=128)
    reference = copy.deepcopy(model)
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16-pure")
    rotary, rotary_ref = model.model.rotary_emb, reference.model.rotary_emb
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, rotary_ref.inv_freq)
    pos = torch.tensor([[0, 511, 2047, 8191]])
    x = torch.zeros(1, 4, 64)                                   # only its dtype and device are read
    cos, sin = rotary(x, pos)
    cos_ref, sin_ref = rotary_ref(x, pos)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    # And a training step with positions near 8k runs and leaves the table exact.
    ids = make_batch(0)
    with mp.autocast():
        positions = torch.arange(8176, 8192)[None].expand(ids.shape[0], -1)
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
    mp.backward(loss)
    mp.step()
    assert torch.equal(rotary.inv_freq, rotary_ref.inv_freq)


def test_gpt2_conv1d_layers_are_swapped_to_fp8_and_state_dict_keys_stay():
    model, make_batch, loss_of = hf_tiny.gpt2()
    keys = list(model.state_dict())
    mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "fp8")
    swapped = set(mp.fp8_report.swapped)
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"} <= swapped
    assert len(mp.fp8_report.layers) == 9 and len(swapped) == 9          # 4 Conv1D per block + lm_head
    decision = next(d for d in mp.fp8_report.layers if d.name == "transformer.h.0.mlp.c_fc")
    assert (decision.out_features, decision.in_features) == (128, 32)    # Conv1D weight is (32, 128)
    assert isinstance(model.transformer.h[0].mlp.c_fc, Fp8Conv1D)
    assert list(model.state_dict()) == keys
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (32, 128)


def test_fp8_conv1d_is_bitwise_an_fp8_linear_over_the_transposed_weight():
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    conv = Conv1D(48, 32)                                        # nf=48 out, nx=32 in: weight (32, 48)
    linear = torch.nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    cfg = Fp8Config.parse("delayed")
    a = Fp8Conv1D.from_conv1d(conv, cfg, backend="emulate")
    b = Fp8Linear.from_linear(linear, cfg, backend="emulate")
    x = torch.randn(2, 5, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(2):                                          # the second step uses the history
        ya, yb = a(xa), b(xb)
        assert torch.equal(ya, yb)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(conv.weight.grad, linear.weight.grad.t())
    assert torch.equal(a.input_history, b.input_history)
    assert a.weight is conv.weight                               # the very Parameter, (in, out)


def test_gpt2_fp8_run_differs_from_bf16():
    # Before Conv1D was swapped, "fp8" on GPT-2 equalled bf16 exactly (only lm_head could be fp8).
    losses = {}
    for recipe in ("bf16", "fp8"):
        model, make_batch, loss_of = hf_tiny.gpt2()
        mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe,
                            fp8_filter=(lambda name, m: name != "lm_head") if recipe == "fp8" else None)
        for step in range(2):
            with mp.autocast():
                loss = loss_of(model, make_batch(step))
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        losses[recipe] = float(loss.detach())
    assert losses["fp8"] != losses["bf16"]


def test_chunked_causal_lm_loss_gives_the_same_gradients_and_saves_no_fp32_log_probs():
    from transformers.loss.loss_utils import ForCausalLMLoss

    from mixprec.diagnostics.memory import SavedTensorMeter
    from mixprec.integrations.hf import causal_lm_loss, use_chunked_loss

    for build in (hf_tiny.llama, hf_tiny.gpt2):
        model, make_batch, loss_of = build()
        twin = copy.deepcopy(model)
        assert use_chunked_loss(twin) and twin.loss_function is causal_lm_loss
        assert not use_chunked_loss(twin)                      # only transformers' own loss is replaced
        ids = make_batch(0)
        results = []
        for m in (model, twin):
            mp = MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-3), "bf16")
            torch.manual_seed(1)                                   # GPT-2's dropout: the same masks
            with SavedTensorMeter(m) as meter, mp.autocast():
                out = m(input_ids=ids, labels=ids)
            mp.backward(out.loss)
            results.append((out.loss.detach(), [p.grad.clone() for p in m.parameters()], meter.groups))
        (loss_a, grads_a, saved_a), (loss_b, grads_b, saved_b) = results
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        logprobs = ids.numel() * hf_tiny.VOCAB * 4                  # 4 x 16 tokens x 64 entries, fp32
        assert saved_a.get(("LogSoftmax", "float32")) == logprobs and ("LogSoftmax", "float32") not in saved_b
    # Gradient accumulation's form: a sum over the tokens divided by the count over all micro-batches.
    logits = torch.randn(2, 8, hf_tiny.VOCAB).to(torch.bfloat16)
    labels = torch.randint(0, hf_tiny.VOCAB, (2, 8))
    n = torch.tensor(40)
    torch.testing.assert_close(causal_lm_loss(logits, labels, hf_tiny.VOCAB, num_items_in_batch=n),
                               ForCausalLMLoss(logits, labels, hf_tiny.VOCAB, num_items_in_batch=n), rtol=1e-6, atol=0)
