#!/usr/bin/env bash
# Prepared in session 19, revised in session 20: the detach decision's figure with more
# repetitions (see 20a): window4-detach over meta-python-detach, window4 over meta-python, in one
# run. bench_record writes after each whole repetition (PARTIAL), so a cut run still reports.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
left=$((575 - SECONDS))
BENCH_CONFIGS=meta-python,meta-python-detach,window4,window4-detach BENCH_REPS=4 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
