#!/usr/bin/env bash
# Session 12's second GPU call: the C++ tape hook after call a's findings (a call inside a taped
# op's kernel is passed straight to its kernel; the autograd threads get a driver context before
# the capture check): its GPU test and the fused tests; the tape's step cost (bench_tape.py, 60
# rounds) with the hook; whole recorded runs with and without the tape (bench_record.py).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/agent/test_cxx_tape.py tests/agent/test_fingerprint_fused.py" \
  OUT=$R timeout 120 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 150 python3 bench/bench_tape.py --rounds ${TAPE_ROUNDS:-60} --arms plain,tape,tape-cxx,tape-passthrough,deterministic \
  --results "$R/tape_step_gpu" > "$R/bench-tape.log" 2>&1
BENCH_CONFIGS=meta,meta-notape BENCH_REPS=${BENCH_REPS:-4} OUT=$R timeout 300 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
