#!/usr/bin/env bash
# Session 12's first GPU call: the tape's C++ hook (its GPU test, and a reference-size recording
# whose taped calls it records), the GPU tests not run on the H200 since they changed (the
# allocator test, CUPTI, the fused fingerprint's direct launch after its one-time check, the
# flight recorder's settle of a Held), and the tape's step cost with the C++ hook, the Python
# override alone (tape-passthrough) and the process's CPU time per step.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_cxx_tape.py tests/agent/test_fingerprint_fused.py tests/system/test_gpu.py::test_without_stored_results_a_differing_kernel_is_named tests/system/test_gpu_memory.py tests/system/test_cupti_gpu.py tests/system/test_gpu.py::test_a_nan_on_the_gpu_dumps_the_window_through_the_payload_ring_and_it_replays_bit_exact" \
  OUT=$R timeout 330 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
TAPE_ROUNDS=${TAPE_ROUNDS:-40} OUT=$R timeout 200 bash bench/gpu_suite.sh tape > "$R/suite-tape.log" 2>&1
