#!/usr/bin/env bash
# Session 10's third GPU call: the fused fingerprint with its pinned slots and self-zeroing sums
# (tests, the reference-size tape tests that replay through it, its per-call cost) and the
# recording-overhead benchmark again.
set -uo pipefail
ROOT=${OUT:-gpu-results}
R=$ROOT/r
mkdir -p "$R"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_fingerprint_fused.py tests/agent/test_payload_ring.py \
  tests/agent/test_fingerprint_many.py tests/system/test_gpu.py::test_lin64_on_the_gpu_matches_the_numpy_reference \
  tests/system/test_gpu.py::test_default_kernels_replay_bit_exact_with_the_recorded_results_injected \
  tests/system/test_gpu.py::test_without_stored_results_a_differing_kernel_is_named" \
  OUT=$R timeout 270 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 60 python3 bench/experiments/tape_fp_cost.py --calls 200 --rounds 5 > "$R/tape_fp_cost.md" 2>&1
BENCH_STEPS=20 BENCH_REPS=2 BENCH_CONFIGS=meta,meta-notape OUT=$R \
  timeout 240 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
tar -C "$R" -czf "$ROOT/results.tar.gz" . && rm -rf "$R"
