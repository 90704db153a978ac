"""SQNR of fp8 linears against the bf16 layer, on random data and on trained lab workloads.

For each case one linear layer runs forward and backward in bf16 (autocast, the reference) and as an
fp8 linear (current and delayed scaling; both after two warm-up steps on two other batches, which
fill the delayed history with amaxes that are not this batch's own). SQNR
in dB = 10 log10(|ref|^2 / |ref - fp8|^2) for the output, the input gradient and the weight gradient.
The issue's floors: outputs >= 20 dB, gradients >= 18 dB.

- random: x ~ N(0, 4), W as nn.Linear initialises it, upstream gradient N(0, 1e-6);
- mlp: the lab's mlp after 300 fp32 steps: its first layer on 256 real test digits, with the gradient
  the real loss sends back through the trained head;
- gpt: the lab's gpt after 200 fp32 steps: every linear of its first block on a real validation batch,
  with the gradients the real loss sends back.

Usage: python benchmarks/fp8/fp8_sqnr.py
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mixprec import Fp8Config
from mixprec.fp8 import Fp8Linear
from mixprec.fp8 import probe_scaled_mm
from mixprec.lab.workloads import get_workload

CONFIGS = {"current": Fp8Config(), "delayed": Fp8Config.parse("delayed")}


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def fwd_bwd(layer: nn.Module, weight: nn.Parameter, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.backward(g.to(out.dtype))
    return out.detach().float(), x.grad.float(), weight.grad.float()


def sqnrs(linear: nn.Linear, batches: list[tuple[torch.Tensor, torch.Tensor]],
          backend: str) -> dict[str, tuple[float, ...]]:
    """SQNRs on the last ``(x, g)`` batch, after the others went through the fp8 layer first."""
    *warmup, (x, g) = batches
    ref = fwd_bwd(linear, linear.weight, x, g)
    out = {}
    for name, cfg in CONFIGS.items():
        layer = Fp8Linear.from_linear(linear, cfg, backend)
        for wx, wg in warmup:
            fwd_bwd(layer, linear.weight, wx, wg)
        got = fwd_bwd(layer, linear.weight, x, g)
        out[name] = tuple(sqnr_db(r, o) for r, o in zip(ref, got))
    return out


def train_fp32(workload_name: str, steps: int) -> tuple[nn.Module, object]:
    workload = get_workload(workload_name)
    torch.manual_seed(0)
    model = workload.build_model()
    opt = workload.make_optimizer(model.parameters())
    data = workload.load_data()
    for _ in range(steps):
        idx = torch.randint(0, len(data.y_train), (workload.batch_size,))
        loss = workload.loss_fn(model(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, data


def captured_io(model: nn.Module, linears: dict[str, nn.Linear], loss_fn, x, y):
    """Inputs and output gradients of ``linears`` in one real forward and backward."""
    x = x.float().requires_grad_(True) if x.is_floating_point() else x   # so backward hooks fire
    inputs, grads, handles = {}, {}, []
    for name, lin in linears.items():
        handles.append(lin.register_forward_hook(lambda m, a, o, n=name: inputs.__setitem__(n, a[0].detach())))
        handles.append(lin.register_full_backward_hook(
            lambda m, gi, go, n=name: grads.__setitem__(n, go[0].detach())))
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
    return inputs, grads


def main() -> None:
    torch.set_num_threads(1)
    backend = "scaled_mm" if probe_scaled_mm("cpu").ok else "emulate"
    print(f"torch {torch.__version__}, cpu, fp8 backend {backend}; SQNR in dB vs the bf16 layer "
          "(output / input grad / weight grad)\n")
    rows = []
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    rows.append(("random 64x256 -> 128", sqnrs(
        lin, [(torch.randn(64, 256) * 2, torch.randn(64, 128) * 1e-3) for _ in range(3)], backend)))

    model, data = train_fp32("mlp", 300)
    io = [captured_io(model, {"0": model[0]}, F.cross_entropy, data.x_test[i:i + 100], data.y_test[i:i + 100])
          for i in (0, 100, 200)]
    rows.append(("mlp layer 0 (64 -> 256)", sqnrs(model[0], [(i["0"], g["0"]) for i, g in io], backend)))

    model, data = train_fp32("gpt", 200)
    block = model.blocks[0]
    linears = {"attn.c_attn": block.attn.c_attn, "attn.c_proj": block.attn.c_proj,
               "mlp.c_fc": block.mlp.c_fc, "mlp.c_proj": block.mlp.c_proj}
    wl = get_workload("gpt")
    io = [captured_io(model, linears, wl.loss_fn, data.x_test[i:i + 16], data.y_test[i:i + 16])
          for i in (0, 16, 32)]
    for name, layer in linears.items():
        rows.append((f"gpt blocks.0.{name} ({layer.in_features} -> {layer.out_features})",
                     sqnrs(layer, [(i[name], g[name]) for i, g in io], backend)))

    print(f"  {'case':<36}{'current':>22}{'delayed':>22}")
    for case, res in rows:
        cells = ["/".join(f"{v:.1f}" for v in res[c]) for c in CONFIGS]
        print(f"  {case:<36}{cells[0]:>22}{cells[1]:>22}")
    worst = {i: min(res[c][i] for _, res in rows for c in CONFIGS) for i in range(3)}
    print(f"\n  lowest: output {worst[0]:.1f} dB (floor 20), input grad {worst[1]:.1f} dB (floor 18), "
          f"weight grad {worst[2]:.1f} dB (floor 18)")


if __name__ == "__main__":
    main()
