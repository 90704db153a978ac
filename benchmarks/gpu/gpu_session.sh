#!/usr/bin/env bash
# Everything a GPU session owes, in three parts that each fit one 10-minute device call:
#   benchmarks/gpu/gpu_session.sh tests   # every CUDA test (tests/gpu), nvidia-smi, versions
#   benchmarks/gpu/gpu_session.sh kernels # step, fp8 linear, op lists, doctor and lockstep benchmarks
#   benchmarks/gpu/gpu_session.sh lab     # compare and inspect on the GPU benchmarks (gpt2, resnet50)
#   benchmarks/gpu/gpu_session.sh e2e     # issue 11: compile tests, bench_fp8 (fused casts, kernel counts),
#                                     # bench_step (compiled step), bench_e2e bf16 eager/compiled
#   benchmarks/gpu/gpu_session.sh e2e-fp8      # issue 11: bench_e2e fp8 vs torch.amp bf16 vs torchao
#   benchmarks/gpu/gpu_session.sh e2e-recipes  # issue 11: bench_e2e for every other recipe
#   benchmarks/gpu/gpu_session.sh parity  # issue 22 (~10 min): the default loop against torch.amp's, every
#                                     # recipe, eager, compiled and compile_step, with aten-op counts
#   benchmarks/gpu/gpu_session.sh doctor  # issue 12 (~3 min): the doctor's Triton counting kernels against the
#                                     # CPU, sync-freedom, and its cost (on/eager/plain) on cuda
# Output goes to $OUT (the device tool's folder) or ./gpu-out; paste it into benchmarks/HISTORY.md with
# the device and the date. Runs from the source tree (PYTHONPATH=src) with the python that holds a CUDA
# torch (default: python3, as on the lent GPU machines, which have torch, rich, matplotlib, scikit-learn,
# ml_dtypes and pytest but no network); set PY to use another.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
MIXPREC="$PY -m mixprec.lab.cli"
run() {   # run NAME CMD...: tee the output to $OUT/NAME.txt and keep going when one fails
    local name=$1; shift
    echo "### $name: $*" | tee "$OUT/$name.txt"
    "$@" 2>&1 | tee -a "$OUT/$name.txt"
    echo "### $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}
case "${1:-}" in
  tests)
    run env sh -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
    run gpu-tests "$PY" -m pytest -q -rs -m gpu tests ;;   # tests/gpu and the gpu-marked tests elsewhere (the Hopper block kernel)
  kernels)
    run bench-step "$PY" benchmarks/step/bench_step.py --device cuda
    run bench-fp8 "$PY" benchmarks/fp8/bench_fp8.py --device cuda
    run bench-oplists "$PY" benchmarks/host/bench_oplists.py --device cuda
    run bench-doctor "$PY" benchmarks/doctor/bench_doctor.py --device cuda
    run bench-dist "$PY" benchmarks/step/bench_dist.py --device cuda --nproc 1
    run bench-usage-checks "$PY" benchmarks/host/bench_usage_checks.py --device cuda --width 1024   # issue 15
    # session 5: two builds per row (the step's time moved with where its memory landed on the CPU)
    run bench-pure-step "$PY" benchmarks/memory/bench_pure_step.py --device cuda --widths 1024,2048,4096 --chunk-mib 64,4 \
        --builds 2
    # issue 13 session 4: step time against chunk_bytes on CUDA (per-chunk launches), to pick the default
    run bench-pure-step-chunks "$PY" benchmarks/memory/bench_pure_step.py --device cuda --widths 4096 \
        --recipes bf16-pure --chunk-mib 16,64,256,1024 --builds 2 ;;
  lab)
    run compare-gpt2 $MIXPREC compare --benchmark gpt2 --device cuda --recipes fp32,tf32,fp16,bf16,fp8 \
        --steps 60 --json "$OUT/compare-gpt2.json"
    run compare-resnet50 $MIXPREC compare --benchmark resnet50 --device cuda --recipes fp32,tf32,fp16,bf16 \
        --steps 60 --json "$OUT/compare-resnet50.json"
    run inspect-gpt2 $MIXPREC inspect --benchmark gpt2 --device cuda --json "$OUT/inspect-gpt2.json"
    # Issue 12: predicted peak against the allocator's on a convnet; why bf16 trails fp16 on ResNet-50
    # (BatchNorm outside cuDNN for bf16? NCHW transposes?) and what channels_last buys.
    run inspect-resnet50 $MIXPREC inspect --benchmark resnet50 --device cuda --recipes fp32,fp16,bf16 \
        --json "$OUT/inspect-resnet50.json"
    run bench-convnet-layout "$PY" benchmarks/step/bench_convnet_layout.py --device cuda --batch 128 ;;
  doctor)   # issue 12: goal on/plain <= 1.5x for gpt; the eager column is the route without torch.compile
    run doctor-tests "$PY" -m pytest -q -rs tests/gpu/test_doctor_cuda.py
    run bench-doctor "$PY" benchmarks/doctor/bench_doctor.py --device cuda
    # session 6: per piece, the compiled kernel + index_add_ against eager ops (no C counter on a GPU)
    run bench-range-count "$PY" benchmarks/doctor/bench_range_count.py --device cuda --sizes 32768,524288 ;;
  e2e)   # issue 11 (~10 min): each bench_e2e run holds its own baseline, so its ratios are side by side
    run compile-tests "$PY" -m pytest -q -rs tests/gpu/test_compile_cuda.py
    run bench-fp8-fused "$PY" benchmarks/fp8/bench_fp8.py --device cuda --sizes 4096,8192
    run bench-fp8-fused-compile "$PY" benchmarks/fp8/bench_fp8.py --device cuda --sizes 8192 --compile
    run bench-step-compiled "$PY" benchmarks/step/bench_step.py --device cuda
    run e2e-bf16 "$PY" benchmarks/step/bench_e2e.py --device cuda --variants amp-bf16,bf16 --steps 20 ;;
  e2e-fp8)   # issue 11 (~10 min): fp8 against torch.amp bf16 and torchao in the same run
    run e2e-fp8 "$PY" benchmarks/step/bench_e2e.py --device cuda --variants amp-bf16,bf16,torchao-fp8,fp8,fp8-delayed \
        --steps 20
    # issue 25: the blocked scalings (rowwise and block on Hopper's kernels; mxfp8/nvfp4 emulated there)
    run e2e-fp8-blocked "$PY" benchmarks/step/bench_e2e.py --device cuda --variants amp-bf16,fp8,fp8-rowwise,fp8-block \
        --steps 20 ;;
  e2e-recipes)
    run e2e-recipes "$PY" benchmarks/step/bench_e2e.py --device cuda --modes eager,compiled --steps 10 \
        --variants amp-bf16,fp16,fp16-pure,bf16-pure,bf16-sr,tf32 ;;
  parity)   # issue 22: goals eager and compiled <= 1.00x, bf16-pure/bf16-sr <= 1.03x, compile_step <= 0.95x
    run parity-eager "$PY" benchmarks/step/bench_parity.py --device cuda --modes eager --pairs 15 \
        --markdown "$OUT/parity-eager.md"
    run parity-compiled "$PY" benchmarks/step/bench_parity.py --device cuda --modes compiled,compile_step \
        --optimizers fused --pairs 15 --markdown "$OUT/parity-compiled.md"
    run step-alone "$PY" benchmarks/step/bench_step_alone.py --device cuda --model lm ;;
  *)
    echo "usage: $0 tests|kernels|lab|doctor|e2e|e2e-fp8|e2e-recipes|parity" >&2; exit 2 ;;
esac
