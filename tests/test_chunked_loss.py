"""mixprec.cross_entropy: F.cross_entropy on the fp32 logits, gradient bit for bit, from 16-bit saves and
chunk-sized fp32 transients; fallbacks equal torch's; the lab's language models use it."""

import pytest
import torch
import torch.nn.functional as F

from mixprec import cross_entropy
from mixprec.diagnostics.memory import SavedTensorMeter
from mixprec.diagnostics.memory_peak import LiveBytesMeter

V = 1000


def logits_and_targets(dtype, rows=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, V, generator=g) * 3).to(dtype).requires_grad_()
    t = torch.randint(0, V, (rows,), generator=g)
    t[5] = t[20] = -100                                     # ignored positions
    return x, t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradient_equals_f_cross_entropy_on_the_fp32_logits_bit_for_bit(dtype, reduction):
    x, t = logits_and_targets(dtype)
    ref = F.cross_entropy(x.float(), t, reduction=reduction)
    grad_out = torch.randn(ref.shape) if reduction == "none" else torch.tensor(0.7)
    (want,) = torch.autograd.grad(ref, x, grad_out)
    got = cross_entropy(x, t, reduction=reduction, chunk_bytes=5 * V * 4)   # 5 rows a chunk: 8 chunks
    (have,) = torch.autograd.grad(got, x, grad_out)
    assert got.dtype == torch.float32 and have.dtype == dtype
    assert torch.equal(have, want)
    # The loss is the same per-row fp32 losses, summed in another order.
    torch.testing.assert_close(got, ref, rtol=4 * 2**-24 * len(t) ** 0.5, atol=0)


def test_label_smoothing_matches_within_fp32_rounding():
    x, t = logits_and_targets(torch.bfloat16)
    ref = F.cross_entropy(x.float(), t, label_smoothing=0.1)
    got = cross_entropy(x, t, label_smoothing=0.1, chunk_bytes=7 * V * 4)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    (want,) = torch.autograd.grad(ref, x)
    (have,) = torch.autograd.grad(got, x)
    assert torch.equal(have, want)                            # bf16 gradients: the fp32 ulps round away


def test_class_dimension_second_and_the_fallbacks_equal_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 3, 4, generator=g, dtype=torch.float32).to(torch.bfloat16)
    t = torch.randint(0, 7, (2, 3, 4), generator=g)
    torch.testing.assert_close(cross_entropy(x, t, reduction="none", chunk_bytes=64),
                               F.cross_entropy(x.float(), t, reduction="none"), rtol=0, atol=0)
    w = torch.rand(7, generator=g)
    assert torch.equal(cross_entropy(x, t, w), F.cross_entropy(x.float(), t, w))
    probs = torch.softmax(torch.randn(2, 7, 3, 4, generator=g), dim=1)
    assert torch.equal(cross_entropy(x, probs), F.cross_entropy(x.float(), probs))


def test_fp32_logits_in_one_chunk_are_plain_f_cross_entropy():
    x, t = logits_and_targets(torch.float32)
    assert torch.equal(cross_entropy(x, t), F.cross_entropy(x, t))


def test_bad_arguments_name_the_fix():
    x, t = logits_and_targets(torch.bfloat16)
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none, got 'avg'"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="37 rows of logits but 36 targets"):
        cross_entropy(x, t[:-1])
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        cross_entropy(x, t, chunk_bytes=0)


def test_wrong_logits_and_targets_are_refused_by_name_not_deep_in_torch():
    x, t = logits_and_targets(torch.bfloat16)
    # Integer "logits" (class ids passed by mistake) used to give a loss, log(C) for equal ids, with no
    # gradient to train on; float class indices failed inside F.cross_entropy; an index past the classes
    # was torch's IndexError.
    with pytest.raises(TypeError, match="input must be floating-point logits .* got torch.int64"):
        cross_entropy(torch.ones(4, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"class probabilities of the logits' shape \(37, 1000\).*target.long\(\)"):
        cross_entropy(x, t.float())
    bad = t.clone()
    bad[5] = V
    for logits, chunk_bytes in ((x, 7 * V * 4), (x.float(), 1 << 20)):   # chunked; one fp32 chunk
        with pytest.raises(ValueError, match=r"not a class index in \[0, 1000\) nor ignore_index=-100"):
            cross_entropy(logits, bad, chunk_bytes=chunk_bytes)
    bad[5] = -100                                       # ignore_index is still a valid target
    assert torch.isfinite(cross_entropy(x, bad))


def test_saves_the_16_bit_logits_not_fp32_log_probabilities():
    x, t = logits_and_targets(torch.bfloat16)
    with SavedTensorMeter() as meter:
        loss = F.cross_entropy(x.float(), t)
    assert meter.by_dtype["float32"] >= 37 * V * 4           # torch saves the fp32 log-probabilities
    with SavedTensorMeter() as meter:
        loss = cross_entropy(x, t)
    assert meter.by_dtype == {"bfloat16": 37 * V * 2, "int64": 37 * 8, "float32": 4}   # logits, targets, count
    # fp32 logits that are a cast of bf16 ones (the CPU output cast) are kept as their bf16 values.
    with SavedTensorMeter() as meter:
        loss = cross_entropy(x.float().reshape(37, V), t, chunk_bytes=5 * V * 4)
    assert meter.by_dtype == {"bfloat16": 37 * V * 2, "int64": 37 * 8, "float32": 4}
    (g,) = torch.autograd.grad(loss, x)
    assert torch.equal(g, torch.autograd.grad(F.cross_entropy(x.float(), t), x)[0])


def test_the_backward_holds_chunk_sized_fp32_transients():
    x, t = logits_and_targets(torch.bfloat16, rows=400)
    full = 400 * V * 4

    def peak(loss_fn):
        loss = loss_fn()
        with LiveBytesMeter() as meter:
            torch.autograd.grad(loss, x)
        return meter.peak

    chunk = 10 * V * 4
    chunked, plain = peak(lambda: cross_entropy(x, t, chunk_bytes=chunk)), peak(lambda: F.cross_entropy(x.float(), t))
    # torch: an fp32 gradient of the log-probabilities and of the logits, then its bf16 cast.
    assert plain >= 2 * full
    # chunked: the bf16 gradient, plus at most three fp32 chunks (log-probs, their gradient, the result).
    assert chunked <= full // 2 + 3 * chunk + 4096


def test_meter_counts_what_the_forward_saves_not_what_a_recompute_saves():
    # With label smoothing the backward differentiates each chunk's own graph, which saves fp32
    # log-probabilities while the backward runs: transients, not saved activations.
    x, t = logits_and_targets(torch.bfloat16)
    with SavedTensorMeter() as meter:
        cross_entropy(x, t, label_smoothing=0.1, chunk_bytes=5 * V * 4).backward()
    assert meter.by_dtype == {"bfloat16": 37 * V * 2, "int64": 37 * 8, "float32": 4}


@pytest.mark.parametrize("recipe", ["bf16,saved=exact", "fp16", "bf16-pure", "fp32"])
def test_training_with_it_equals_training_with_f_cross_entropy_bit_for_bit(recipe):
    from mixprec import MixedPrecision
    from mixprec.lab.models import GPT, GPTConfig

    def train(loss_fn):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=103, block_size=16, n_layer=2, n_head=2, n_embd=32))
        mp = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            ids = torch.randint(0, 103, (4, 16), generator=g)
            with mp.autocast():
                loss = loss_fn(model(ids).flatten(0, 1), ids.flatten())
            mp.backward(loss)
            mp.step()
            mp.zero_grad()
        return model.state_dict()

    plain = train(F.cross_entropy)
    chunked = train(lambda x, t: cross_entropy(x, t, chunk_bytes=20 * 103 * 4))    # 4 chunks of 20 rows
    assert all(torch.equal(plain[k], chunked[k]) for k in plain)
