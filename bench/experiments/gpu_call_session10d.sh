#!/usr/bin/env bash
# Session 10's fourth GPU call: the fused fingerprint after its argument-type fix, the
# reference-size tape test with a ring large enough for the taped results, and the per-call cost.
set -uo pipefail
ROOT=${OUT:-gpu-results}
R=$ROOT/r
mkdir -p "$R"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_fingerprint_fused.py tests/agent/test_fingerprint_many.py \
  tests/system/test_gpu.py::test_default_kernels_replay_bit_exact_with_the_recorded_results_injected" \
  OUT=$R timeout 200 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 50 python3 bench/experiments/tape_fp_cost.py --calls 200 --rounds 5 > "$R/tape_fp_cost.md" 2>&1
tar -C "$R" -czf "$ROOT/results.tar.gz" . && rm -rf "$R"
