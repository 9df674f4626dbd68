#!/usr/bin/env bash
# Prepared in session 19 as part of 20b, split out in session 20: session 16's call e bench, never
# run: meta, meta-detach, meta-nocupti (what CUPTI's default window leaves in the steps after it,
# with the C++ kernel). Run it with the device time left after 20a and 20b.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
left=$((575 - SECONDS))
CUPTI_BENCH_CONFIGS=meta,meta-detach,meta-nocupti BENCH_REPS=3 BENCH_STEPS=20 OUT=$R timeout $left \
  bash bench/gpu_suite.sh cupti > "$R/suite-cupti.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-cupti.log"
