#!/usr/bin/env bash
# Session 11's second GPU call: where a taped call's host time goes (tape_call_cost.py), and the
# flight recorder's GPU test after its dump stopped writing the payloads held for the late check.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/system/test_gpu.py::test_a_nan_on_the_gpu_dumps_the_window_through_the_payload_ring_and_it_replays_bit_exact" \
  OUT=$R timeout 150 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 150 python3 bench/experiments/tape_call_cost.py --calls 200 --rounds 7 > "$R/tape_call_cost.md" 2>&1
