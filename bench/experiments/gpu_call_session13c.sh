#!/usr/bin/env bash
# Session 13's third GPU call: the flight recorder's healthy-step cost on the reference step with
# its own memory bound (--window-bytes, sized from the host's memory by default): window4 against
# metadata-only with the same (Python) kernels, meta-python (#13's target: within 2%); with meta
# (the tape's C++ hook) and meta-notape for the whole-run cost of the tape.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
BENCH_CONFIGS=meta-python,window4,meta,meta-notape BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=25 \
  OUT=$R timeout 470 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
