#!/usr/bin/env bash
# Session 13's first GPU call: the C++ tape hook's GPU test on the shared-state layout of f75ed23
# (not yet run on a GPU) with the flight recorder's GPU test; then whole recorded runs on the
# reference step (bench_record.py): metadata-only with the tape's C++ hook (meta), without the
# tape (meta-notape), with the Python kernels (meta-python) and the flight recorder (window4,
# compared with meta-python: #13's healthy-step target, within 2%).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_cxx_tape.py tests/system/test_gpu.py::test_a_nan_on_the_gpu_dumps_the_window_through_the_payload_ring_and_it_replays_bit_exact" \
  OUT=$R timeout 150 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
BENCH_CONFIGS=meta,meta-notape,meta-python,window4 BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=25 \
  OUT=$R timeout 420 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
