#!/usr/bin/env bash
# Session 11's first GPU call: the reference-size tape test as corrected in session 10, the CUDA
# graph test, the flight recorder through the payload ring (new), then the tape's marginal cost per
# step (bench_tape.py, arms interleaved in one process). Results in one archive (the device returns
# at most 8 files).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_fingerprint_fused.py tests/agent/test_tape.py \
  tests/system/test_gpu.py::test_a_nan_on_the_gpu_dumps_the_window_through_the_payload_ring_and_it_replays_bit_exact \
  tests/system/test_gpu.py::test_default_kernels_replay_bit_exact_with_the_recorded_results_injected" \
  OUT=$R timeout ${TESTS_S:-330} bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
TAPE_ROUNDS=${TAPE_ROUNDS:-40} OUT=$R timeout ${TAPE_S:-200} bash bench/gpu_suite.sh tape > "$R/suite-tape.log" 2>&1
