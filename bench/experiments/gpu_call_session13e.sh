#!/usr/bin/env bash
# Session 13's fifth GPU call: the flight recorder's healthy-step cost on the reference step with
# a payload ring large enough that nothing is dropped (call d: the default 256 MiB ring dropped 380
# of 636 taped results in 12 steps, all for want of ring room; a 2 GiB ring dropped none).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
BENCH_CONFIGS=meta-python,window4-ring2g BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=25 \
  OUT=$R timeout 330 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
