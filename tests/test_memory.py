"""Memory accounting against numbers worked out by hand (seed 002's MLP) and against the tensors."""

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.diagnostics.memory import SavedTensorMeter, state_bytes, storage_bytes

# Seed 002's MLP, 784-8192-10: 784*8192 + 8192 + 8192*10 + 10 = 6,512,650 parameters.
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
    assert pure.grads == 2 * N_PARAMS + 4 * N_PARAMS     # fp16 model grads + fp32 master grads


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
