"""Kernel names recorded by torch.profiler on one H100 80GB (torch 2.11, cuBLAS of CUDA 13), 2026-11-22,
in ../shared/gpu-findings/h100-2026-11-22/{tests,profiles,inspect-gpt2}.txt, with the dtypes of the op
that launched each (from the run that recorded it) and what the kernel is. Names the profile tables had
cut at ~110 characters are kept cut: the classifier must work on them too.

Each entry: (name, launching op's input dtypes as the profiler spells them, tensor_cores expected).
"""

FP32, HALF, BF16 = "float", "c10::Half", "c10::BFloat16"
E4M3, E5M2 = "c10::Float8_e4m3fn", "c10::Float8_e5m2"

KERNELS = [
    # fp32 GEMMs with TF32 off: FFMA on the CUDA cores (tests.txt: counted as tensor cores before).
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_"
     "execute_kernel__5x_c", (FP32, FP32, FP32), False),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_"
     "execute_kernel__5x_cublas", (FP32, FP32), False),
    # inspect-gpt2.txt's "longest" fp32 kernel, cut before "ffma": the type string alone says fp32 math.
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stag", (FP32, FP32), False),
    # cuBLASLt nvjet kernels: hsh = fp16, tst = bf16, qqtst = e4m3 x e4m3, qrtst = e4m3 x e5m2.
    ("nvjet_sm90_hsh_24x64_64x16_4x2_h_bz_bias_TNN", (HALF, HALF, HALF), True),
    ("nvjet_sm90_hsh_32x64_64x16_2x1_v_bz_NTN", (HALF, HALF), True),
    ("nvjet_sm90_hsh_64x24_64x16_2x4_h_bz_NNT", (HALF, HALF), True),
    ("nvjet_sm90_hsh_192x192_64x3_2x1_v_bz_coopB_NNN", (HALF, HALF), True),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", (BF16, BF16), True),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", (BF16, BF16), True),
    ("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", (BF16, BF16, BF16), True),
    ("nvjet_sm90_qqtst_144x128_128x6_1x2_h_bz_coopA_algo2_TNN", (E4M3, E4M3, FP32, FP32), True),
    ("nvjet_sm90_qrtst_144x128_128x6_1x2_h_bz_coopA_algo2_TNN", (E5M2, E4M3, FP32, FP32), True),
    # CUTLASS WMMA kernels (fp16 mm on small shapes).
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align2>(cutlass_80_wmma_tens",
     (HALF, HALF), True),
    ("void cutlass::Kernel2<cutlass_75_wmma_tensorop_s161616gemm_f16_32x32_64x2_nt_align1>(cutlass_75_wmma_tensorop_",
     (HALF, HALF), True),
    # Not matmuls: the split-K reduction after a GEMM, Inductor kernels whose fused-op list names
    # _scaled_mm, ATen elementwise/reduction/optimizer kernels, copies.
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __half, float, __half, false, __half, __half, __half, t",
     (HALF, HALF), False),
    ("triton_poi_fused__scaled_mm__to_copy_abs_bitwise_and_clamp_clone_eq_gt_isinf_mul_ne_ones_like_reciprocal_scala",
     (), False),
    ("triton_red_fused_linalg_vector_norm_0", (), False),
    ("triton_per_fused__to_copy_abs_bitwise_and_clamp_copy__eq_gt_linalg_vector_norm_mul_ne_ones_like_reciprocal_whe",
     (), False),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::float16_copy_kernel_cuda(at::TensorIteratorBase&",
     (FP32,), False),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::float8_copy_kernel_",
     (BF16,), False),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::AbsMaxOps<c10::BFloat16",
     (BF16,), False),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedOpti",
     (FP32,), False),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, flo",
     (FP32,), False),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::GeluBackwardCUDAKernelImpl(at::TensorIteratorBas",
     (HALF, HALF), False),
    ("Memcpy DtoD (Device -> Device)", (), False),
    ("Memset (Device)", (), False),
]
