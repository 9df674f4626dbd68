#!/usr/bin/env bash
# Session 23's second call: more repetitions of window4 over meta-python (the flight recorder's own
# cost on healthy steps) on the machine kind that call 23a ran on, to pool with its 3.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
left=$((585 - SECONDS))
BENCH_CONFIGS=meta-python,window4 BENCH_REPS=6 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
