#!/usr/bin/env bash
# Session 11's fourth GPU call: a taped call's host time with the final fused fingerprint
# (tape_call_cost.py, fixed for the kernel's layout arguments), then whole recorded runs against
# unrecorded ones (bench_record.py: metadata + fingerprints + the tape, the same without the tape,
# and deterministic mode, interleaved).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
OUT=$R GPU_TESTS=none bash bench/gpu_suite.sh none > "$R/suite-setup.log" 2>&1  # installs .whl, builds the core
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 80 python3 bench/experiments/tape_call_cost.py --calls 200 --rounds 7 > "$R/tape_call_cost.md" 2>&1
BENCH_STEPS=25 BENCH_REPS=3 BENCH_CONFIGS=deterministic,meta,meta-notape OUT=$R timeout 420 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
