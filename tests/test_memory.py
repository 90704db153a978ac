"""Memory accounting against numbers worked out by hand (a 784-8192-10 MLP) and against the tensors."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

from mixprec import MixedPrecision, memory_report
from mixprec.lab.models import GPT, GPTConfig
from mixprec.diagnostics.memory import SavedTensorMeter, state_bytes, storage_bytes

# A 784-8192-10 MLP (MNIST-sized): 784*8192 + 8192 + 8192*10 + 10 = 6,512,650 parameters.
N_PARAMS = 784 * 8192 + 8192 + 8192 * 10 + 10


def seed_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 8192), nn.ReLU(), nn.Linear(8192, 10))


def one_step(recipe, optimizer=torch.optim.SGD, batch=8):
    model = seed_mlp()
    mp = MixedPrecision(model, optimizer(model.parameters(), lr=1e-3), recipe)
    x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))
    with SavedTensorMeter(model, mp.master.masters if mp.master else []) as meter:
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
    mp.step()
    return state_bytes(mp), meter.bytes


def test_seed_002_model_memory_fp32_and_fp16_with_master():
    fp32, _ = one_step("fp32")
    pure, _ = one_step("params=fp16,compute=fp16,master=fp32,scale=static:8")
    assert fp32.params == 4 * N_PARAMS and round((fp32.params + fp32.master) / 1e6, 2) == 26.05
    assert pure.params == 2 * N_PARAMS and pure.master == 4 * N_PARAMS
    assert round((pure.params + pure.master) / 1e6, 2) == 39.08
    # fp16 model grads only: the fp32 copies' gradients live one chunk of one step (update/chunks.py).
    assert pure.grads == 2 * N_PARAMS


def test_adam_holds_two_fp32_moments_per_parameter():
    fp32, _ = one_step("fp32", torch.optim.Adam)
    pure, _ = one_step("params=fp16,compute=fp16,master=fp32,scale=static:8", torch.optim.Adam)
    # Two fp32 moments per parameter plus one scalar step counter per tensor (4 tensors).
    assert fp32.optimizer == pure.optimizer == 8 * N_PARAMS + 4 * 4
    # Bytes per parameter with Adam: 16 for fp32 (w 4 + g 4 + m,v 8); classic mixed precision:
    # w16 2 + master 4 + m,v 8 = 14 held, plus the gradients.
    assert (fp32.params + fp32.grads + fp32.optimizer) // N_PARAMS == 16


def test_saved_activations_halve_in_fp16():
    _, fp32 = one_step("fp32", batch=64)
    _, pure = one_step("params=fp16,compute=fp16,master=fp32,scale=static:8", batch=64)
    # fp32 saves x (64x784), the hidden pre/post ReLU (64x8192, ReLU output saved for the next matmul
    # and its mask) and the logits; the pure recipe saves the same shapes in fp16 (logits are cast to
    # fp32 for the loss, so the last tensors stay fp32).
    assert 0.45 < pure / fp32 < 0.6


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(100)
    assert storage_bytes([a, a[10:], a.view(10, 10), None]) == 400
    assert storage_bytes([a, torch.zeros(10, dtype=torch.float16)]) == 420


# ------------------------------------------------------------------ memory_report: predicted vs measured


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def test_memory_report_reproduces_seed_002_and_003_without_training():
    model, batch = seed_mlp(), (torch.randn(64, 784), torch.randint(0, 10, (64,)))
    fp32 = memory_report(model, "fp32", batch, optimizer=adam, loss_fn=F.cross_entropy)
    amp = memory_report(model, "fp16", batch, optimizer=adam, loss_fn=F.cross_entropy)
    pure = memory_report(model, "params=fp16,compute=fp16,master=fp32,scale=static:8", batch, optimizer=adam,
                         loss_fn=F.cross_entropy)
    assert fp32.n_params == N_PARAMS
    assert round(fp32.predicted.params / 1e6, 2) == 26.05
    assert round((pure.predicted.params + pure.predicted.master) / 1e6, 2) == 39.08
    # The usual Adam accounting: fp32 holds w 4 + g 4 + m,v 8 = 16 B/param; torch.amp-style fp16 (fp32 weights) too.
    # Plus one fp32 step counter per tensor: 4 tensors * 4 B.
    assert fp32.predicted.optimizer == 8 * N_PARAMS + 16
    assert fp32.bytes_per_param == amp.bytes_per_param == pytest.approx(16.0, abs=1e-5)
    # Classic mixed precision is 2 + 2 + 4 + 8 = 16 in the seed, and so is mixprec's: the fp32 copies'
    # gradients are transients of one chunk of the step, not held (the 16 bytes of step counters are
    # the 1e-5 of slack).
    assert pure.predicted.grads == 2 * N_PARAMS
    assert pure.bytes_per_param == pytest.approx(16.0, abs=1e-5)
    # The model was only traced: still fp32, no gradients.
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert 0.45 < pure.predicted.activations / fp32.predicted.activations < 0.6


@pytest.mark.parametrize("recipe", ["fp32", "fp16", "bf16", "fp16-pure", "bf16-pure", "bf16-sr"])
def test_predicted_memory_equals_measured_on_cpu(recipe):
    # tiny_model has a LayerNorm that pure recipes keep fp32: weights of two dtypes, casting hooks.
    model = tiny_model(d_in=8, hidden=32, d_out=4)
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    report = memory_report(model, recipe, batch, optimizer=adam, loss_fn=F.cross_entropy, measure=True)
    # peak: predicted always (test_memory_peak.py checks it), measured only by the CUDA allocator.
    assert report.measured == dataclasses.replace(report.predicted, peak=None)
    assert report.saved == report.saved_measured and sum(b for *_, b in report.saved) == report.predicted.activations
    assert report.predicted.activations > 0 and report.predicted.optimizer > 0


def test_optimizer_given_as_instance_with_groups_and_momentum():
    model = tiny_model()
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    sgd = torch.optim.SGD([{"params": decay, "momentum": 0.9}, {"params": rest, "momentum": 0.0}], lr=0.1)
    report = memory_report(model, "fp32", torch.randn(4, 8), optimizer=sgd, measure=True)
    # One fp32 momentum buffer per matrix, none for vectors.
    assert report.predicted.optimizer == 4 * sum(p.numel() for p in decay) == report.measured.optimizer
    assert memory_report(model, "fp32", torch.randn(4, 8)).predicted.optimizer == 0


def test_a_meta_model_is_predicted_like_the_real_one():
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    real = GPT(config)
    with torch.device("meta"):
        meta = GPT(config)
    ids = torch.zeros(4, 16, dtype=torch.int64)
    loss = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    a = memory_report(real, "bf16", (ids, ids), optimizer=adam, loss_fn=loss, measure=True)
    b = memory_report(meta, "bf16", (ids, ids), optimizer=adam, loss_fn=loss)
    assert a.predicted == b.predicted and dataclasses.replace(a.predicted, peak=None) == a.measured
    with pytest.raises(ValueError, match="meta device"):
        memory_report(meta, "bf16", (ids, ids), loss_fn=loss, measure=True)


def test_memory_report_bad_input():
    with pytest.raises(ValueError, match="no trainable parameters"):
        memory_report(nn.ReLU(), "fp32", torch.randn(2, 3))
    with pytest.raises(ValueError, match="unknown recipe"):
        memory_report(tiny_model(), "fp17", torch.randn(2, 8))
    with pytest.raises(TypeError, match="optimizer must be"):
        memory_report(tiny_model(), "fp32", torch.randn(2, 8), optimizer="adam")
    with pytest.raises(ValueError, match=r"\(inputs, targets\)"):
        memory_report(tiny_model(), "fp32", torch.randn(2, 8), loss_fn=F.cross_entropy)
    # Were "'str' object is not callable" from inside the trace, and torch's "linear(): argument 'input'
    # must be Tensor, not NoneType".
    batch = (torch.randn(2, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"loss_fn must be a function loss_fn\(outputs, targets\).*str 'cross_entropy'"):
        memory_report(tiny_model(), "fp32", batch, loss_fn="cross_entropy")
    for empty in (None, (), {"x": 3}):
        with pytest.raises(ValueError, match="batch holds no tensor"):
            memory_report(tiny_model(), "fp32", empty)


def test_a_model_the_fake_trace_cannot_run_is_one_error_without_torchs_logged_traceback():
    # A wrong input width: torch logged "failed while attempting to run meta for aten.mm.default" with a
    # full traceback to stderr, then memory_report raised its ValueError.
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    log = logging.getLogger("torch._subclasses.fake_tensor")     # its own handler; does not propagate
    log.addHandler(handler)
    level = log.level
    try:
        with pytest.raises(ValueError, match=r"cannot predict the memory of Sequential: tracing it with fake "
                                             r"tensors \(shapes only\) failed: .*\[4, 9\] X \[8, 16\]"):
            memory_report(tiny_model(), "fp16", (torch.randn(4, 9), torch.zeros(4, dtype=torch.long)),
                          loss_fn=F.cross_entropy)
    finally:
        log.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.ERROR]
    assert log.level == level                                     # the logger is left as it was


def test_saved_activations_split_by_op_and_dtype_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.randn(8, 4)
    with SavedTensorMeter(model) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
    # addmm 1 saves autocast's bf16 copy of x (8x4x2 B; x needs no grad, so its cast has no grad_fn);
    # relu saves its output (8x3x2), which addmm 2 saves too (counted once), and addmm 2 saves the
    # bf16 copy of its weight (2x3x2) to give x's path its gradient.
    assert meter.groups == {("no grad_fn", "bfloat16"): 64, ("Relu", "bfloat16"): 48,
                            ("cast of a weight", "bfloat16"): 12}
    assert meter.by_dtype == {"bfloat16": 124} and meter.bytes == 124


def test_memory_report_says_what_to_fix_for_a_missing_loss_fn_and_integer_inputs():
    # Were "forward() takes 2 positional arguments but 3 were given" and torch's dtype mismatch (or, with
    # measure=False, a prediction for a forward that cannot run).
    model = tiny_model()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with pytest.raises(ValueError, match=r"as positional inputs.*give the loss: memory_report\(model, recipe, "
                                         r"\(x, y\), loss_fn=F.cross_entropy\)"):
        memory_report(model, "fp16", (x, y))
    for measure in (False, True):
        with pytest.raises(ValueError, match="the batch's inputs are int64 and Sequential has no nn.Embedding to "
                                             r"take integer ids: pass floating-point inputs \(e.g. x.float\(\)\)"):
            memory_report(model, "fp16", (x.long(), y), loss_fn=F.cross_entropy, measure=measure)
    # Token ids into a model with an embedding are what it expects.
    lm = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    ids = torch.randint(0, 10, (2, 5))
    report = memory_report(lm, "fp16", (ids, ids), loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
    assert report.predicted.params == (80 + 80 + 10) * 4
