#!/usr/bin/env bash
# Session 11's fifth GPU call: the final fused fingerprint (layouts remembered): its GPU tests, a
# taped call's host time (tape_call_cost.py) and the tape's cost per step (bench_tape.py).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_fingerprint_fused.py" OUT=$R timeout 100 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 80 python3 bench/experiments/tape_call_cost.py --calls 200 --rounds 7 > "$R/tape_call_cost.md" 2>&1
TAPE_ROUNDS=${TAPE_ROUNDS:-60} OUT=$R timeout 150 bash bench/gpu_suite.sh tape > "$R/suite-tape.log" 2>&1
