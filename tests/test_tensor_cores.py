"""Tensor-core eligibility: FLOPs worked out by hand, misaligned dims, padding advice, meta-only tracing."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.diagnostics.kernel_kinds import classify_kernel
from mixprec.diagnostics.tensor_cores import (_kernel_profile, alignment, is_tensor_core_kernel, padded_size,
                                              profile_kernels, trace_matmuls)
from mixprec.lab.models import GPT, GPTConfig

from kernel_names_h100 import KERNELS


def test_linear_forward_and_both_backward_matmuls_have_hand_computed_flops():
    B, K, N = 12, 40, 24
    model = nn.Sequential(nn.Linear(K, N))
    x = torch.randn(B, K, requires_grad=True)      # the input needs a gradient: both backward matmuls run
    report = trace_matmuls(model, x)
    ops = [(o.op, o.direction, o.module, o.flops) for o in report.ops]
    assert ops == [("aten.addmm.default", "forward", "0", 2 * B * N * K),      # x @ W^T
                   ("aten.mm.default", "backward", "0", 2 * B * K * N),        # dx = dy @ W
                   ("aten.mm.default", "backward", "0", 2 * N * K * B)]        # dW = dy^T @ x
    assert report.total_flops == 3 * 2 * B * N * K
    # The forward's dims and their roles: N and K are the layer's, M = B is the batch.
    assert report.ops[0].dims == (("M", B, "activation"), ("N", N, "weight"), ("K", K, "weight"))


def test_input_without_grad_skips_the_input_gradient_matmul():
    report = trace_matmuls(nn.Linear(16, 8), torch.randn(4, 16))
    assert [o.direction for o in report.ops] == ["forward", "backward"]


def test_vocabulary_50257_is_flagged_and_padded_to_50304():
    V, C, B = 50257, 64, 16
    model = nn.Sequential(nn.Embedding(V, C), nn.Linear(C, V, bias=False))
    ids = torch.zeros(B, dtype=torch.int64)
    report = trace_matmuls(model, (ids, ids), loss_fn=F.cross_entropy)
    head = [o for o in report.ops if o.module == "1"]
    assert len(head) == 3 and all(o.flops == 2 * B * C * V for o in head)
    assert report.misaligned_share(8) == 1.0          # the head is the only matmul, and V is odd
    fixes = report.fixes(8)
    assert [(f.size, f.role, f.pad_to, f.modules) for f in fixes] == [(V, "weight", 50304, ("1",))]
    assert "50257 -> 50304" in fixes[0].advice and "100.0%" in fixes[0].advice


def test_batch_not_a_multiple_of_8_gets_batch_advice_and_fp8_is_stricter():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 24))
    report = trace_matmuls(model, torch.randn(12, 64))
    assert report.misaligned_share(8) == 1.0        # every matmul has M = 12 or K = 12
    (fix,) = report.fixes(8)
    assert (fix.size, fix.role) == (12, "activation") and "batch size 12 -> 16" in fix.advice
    # 24 is a multiple of 8 but not of 16: only fp8 flags the head.
    aligned = trace_matmuls(model, torch.randn(16, 64))
    assert aligned.misaligned_share(8) == 0.0
    head_flops = sum(o.flops for o in aligned.ops if o.module == "2")
    assert aligned.misaligned_share(16) == pytest.approx(head_flops / aligned.total_flops)
    assert [f.pad_to for f in aligned.fixes(16)] == [32]


def test_convolution_channels_and_flops():
    conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
    x = torch.randn(2, 3, 8, 8)
    report = trace_matmuls(conv, x)
    fwd, bwd = report.ops
    # Every output pixel: C_in * 3 * 3 multiply-adds per output channel.
    assert fwd.flops == 2 * (2 * 8 * 8) * 16 * (3 * 3 * 3)
    assert bwd.op == "aten.convolution_backward.default" and bwd.flops == fwd.flops   # weight grad only
    assert fwd.dims == (("C_in", 3, "weight"), ("C_out", 16, "weight"))
    assert [f.pad_to for f in report.fixes(8)] == [8]


def test_gpt2_small_traces_on_meta_without_allocating():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768))
    ids = torch.zeros(2, 1024, dtype=torch.int64)
    report = trace_matmuls(model, (ids, ids), loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()))
    head = [o for o in report.ops if o.module == "lm_head"]
    assert [o.flops for o in head] == [2 * 2048 * 768 * 50304] * 3
    assert report.misaligned_share(8) == 0.0
    assert all(p.device.type == "meta" for p in model.parameters())


def test_attention_matmuls_are_attributed_to_the_attention_module():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32))
    ids = torch.zeros(3, 32, dtype=torch.int64)
    report = trace_matmuls(model, ids)
    bmm = [o for o in report.ops if o.op == "aten.bmm.default"]
    assert {o.module for o in bmm} == {"blocks.0.attn"}
    assert sum(o.direction == "forward" for o in bmm) == 2 and sum(o.direction == "backward" for o in bmm) == 4
    # q @ k^T per head: (T x hs) @ (hs x T), over B * heads batches.
    assert bmm[0].flops == 2 * (3 * 2) * 32 * 32 * 16


def test_model_that_reads_values_cannot_be_traced_and_says_so():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y if y.sum() > 0 else -y         # reads a value: impossible on meta
    with pytest.raises(ValueError, match="cannot trace DataDependent on the meta device"):
        trace_matmuls(DataDependent(), torch.randn(2, 4))
    with pytest.raises(ValueError, match="no parameters"):
        trace_matmuls(nn.ReLU(), torch.randn(2, 4))


def test_alignment_rules_and_padding():
    assert alignment(torch.float16) == alignment("bf16") == 8
    assert alignment(torch.float8_e4m3fn) == 16 and alignment("tf32") == 4 and alignment(torch.float32) is None
    assert padded_size(50257, 8) == 50304 and padded_size(100, 8) == 104 and padded_size(10, 16) == 16
    assert padded_size(64, 8) == 64


def test_kernel_names():
    assert is_tensor_core_kernel("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn")
    assert is_tensor_core_kernel("volta_h884gemm_64x64_ldg8_nn")
    assert is_tensor_core_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
    assert is_tensor_core_kernel("sm86_xmma_fprop_implicit_gemm_indexed_f32f32_tf32f32_f32_nhwckrsc_nhwc")
    assert is_tensor_core_kernel("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT")
    assert not is_tensor_core_kernel("ampere_sgemm_128x64_tn")
    assert not is_tensor_core_kernel("cutlass_80_simt_sgemm_128x32_8x5_nn_align1")
    assert not is_tensor_core_kernel("void at::native::vectorized_elementwise_kernel<4, float>")


@pytest.mark.parametrize("name, dtypes, expected", KERNELS, ids=[k[0][:48] for k in KERNELS])
def test_kernels_recorded_on_the_h100_are_classified_by_what_they_are(name, dtypes, expected):
    assert classify_kernel(name, dtypes).tensor_cores is expected
    assert classify_kernel(name).tensor_cores is expected      # the name alone says it, too


def test_unclear_or_contradicted_kernels_are_unknown_not_guessed():
    # An all-fp32 nvjet kernel may be TF32 (tensor cores) or not: the name does not say.
    assert classify_kernel("nvjet_sm90_sss_128x64_64x8_1x1_v_bz_NNT", ["float"]).tensor_cores is None
    # The name says fp16 operands, the op had fp32 only: one of the two is not what it seems.
    c = classify_kernel("nvjet_sm90_hsh_24x64_64x16_4x2_h_bz_bias_TNN", ["float", "float"])
    assert c.tensor_cores is None and "16bit" in c.reason and "fp32" in c.reason
    # Inductor's matmul templates: tl.dot on fp16 is MMA; on fp32 it depends on the TF32 setting.
    assert classify_kernel("triton_tem_fused_mm_0", ["c10::Half", "c10::Half"]).tensor_cores is True
    assert classify_kernel("triton_tem_fused_mm_0", ["float", "float"]).tensor_cores is None
    # Memory-efficient attention: MMA for fp16; fp32 runs 3xTF32 or SIMT depending on the build.
    assert classify_kernel("fmha_cutlassF_f16_aligned_64x64_rf_sm80").tensor_cores is True
    assert classify_kernel("fmha_cutlassF_f32_aligned_64x64_rf_sm80").tensor_cores is None


def _event(name, device, dtypes=(), kernels=(), annotation=False, us=0.0):
    return SimpleNamespace(name=name, device_type=device, input_dtypes=list(dtypes), device_time_total=us,
                           kernels=[SimpleNamespace(name=k, duration=us) for k in kernels],
                           is_user_annotation=annotation)


def test_kernel_profile_links_kernels_to_their_ops_dtypes_and_skips_annotations():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ffma = "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4"
    sss = "nvjet_sm90_sss_64x64_64x8_1x1_v_bz_NNT"
    hsh = "nvjet_sm90_hsh_64x24_64x16_2x4_h_bz_NNT"
    events = [
        _event("aten::mm", cpu, ["float", "float"], kernels=[ffma, sss]),
        _event("aten::mm", cpu, ["c10::Half", "c10::Half"], kernels=[hsh]),
        _event(ffma, cuda, us=30.0), _event(ffma, cuda, us=10.0), _event(sss, cuda, us=20.0),
        _event(hsh, cuda, us=40.0),
        # A span over the optimizer's kernels, as the profiler lists it among device events: 320 us
        # that would count twice.
        _event("Optimizer.step#AdamW.step", cuda, us=320.0, annotation=True),
        _event("Optimizer.step#AdamW.step", cuda, us=320.0),      # a torch without is_user_annotation
    ]
    prof = _kernel_profile(events)
    assert [(k.name, k.calls, k.time_us, k.tensor_cores) for k in prof.kernels] == [
        (ffma, 2, 40.0, False), (hsh, 1, 40.0, True), (sss, 1, 20.0, None)]
    assert prof.tensor_core_share == 0.4 and prof.unknown_share == 0.2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error; the GPU path is tests/gpu")
def test_profiling_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        profile_kernels(lambda: None)
