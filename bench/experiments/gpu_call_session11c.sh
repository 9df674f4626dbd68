#!/usr/bin/env bash
# Session 11's third GPU call: the fused fingerprint reading strided outputs in place and launching
# the compiled kernel directly (GPU tests: values against the reference; the reference-size tape
# test: recorded fingerprints equal to the replay's torch-path ones), then a taped call's host time
# (tape_call_cost.py) and the tape's cost per step (bench_tape.py).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_fingerprint_fused.py tests/agent/test_fingerprint_many.py tests/agent/test_tape.py \
  tests/system/test_gpu.py::test_default_kernels_replay_bit_exact_with_the_recorded_results_injected" \
  OUT=$R timeout 300 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 80 python3 bench/experiments/tape_call_cost.py --calls 200 --rounds 7 > "$R/tape_call_cost.md" 2>&1
TAPE_ROUNDS=${TAPE_ROUNDS:-40} OUT=$R timeout 150 bash bench/gpu_suite.sh tape > "$R/suite-tape.log" 2>&1
