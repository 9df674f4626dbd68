#!/usr/bin/env bash
# Session 10's second GPU call: the recording-overhead benchmark at the reference size, default
# kernels, with the tape's fingerprints by the one Triton launch (meta), by torch ops
# (meta-torchfp), without the tape (meta-notape), and deterministic mode, side by side.
set -uo pipefail
ROOT=${OUT:-gpu-results}
BENCH_STEPS=${BENCH_STEPS:-25} BENCH_REPS=${BENCH_REPS:-3} \
  BENCH_CONFIGS=${BENCH_CONFIGS:-deterministic,meta,meta-torchfp,meta-notape} \
  OUT=$ROOT bash bench/gpu_suite.sh bench > "$ROOT/suite-bench.log" 2>&1
ls "$ROOT"
