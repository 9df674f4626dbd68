#!/usr/bin/env bash
# Prepared in session 19: the second half of the detach decision (see 20a), and the flight
# recorder's figure with more repetitions. 1. session 16's call e bench: meta, meta-detach,
# meta-nocupti (what CUPTI's default window leaves in the steps after it, with the C++ kernel);
# 2. window4 against window4-detach again, as time allows.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
CUPTI_BENCH_CONFIGS=meta,meta-detach,meta-nocupti BENCH_REPS=3 BENCH_STEPS=20 OUT=$R timeout 300 \
  bash bench/gpu_suite.sh cupti > "$R/suite-cupti.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-cupti.log"
mkdir -p "$R/flight"
left=$((575 - SECONDS))
BENCH_CONFIGS=meta-python,window4,window4-detach BENCH_REPS=3 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R/flight timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
