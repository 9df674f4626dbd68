#!/usr/bin/env bash
# Session 10's first GPU call: the fused fingerprint's tests and cost, a py-spy profile of the
# tape's host time, and the payload ring's benchmark with its kernel-copy arm. Results: one
# archive, $OUT/results.tar.gz.
set -uo pipefail
ROOT=${OUT:-gpu-results}
R=$ROOT/r
mkdir -p "$R"
export OUT=$R
GPU_TESTS="tests/agent/test_fingerprint_fused.py tests/agent/test_payload_ring.py tests/agent/test_fingerprint_many.py" \
  timeout 240 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 120 python3 bench/experiments/tape_fp_cost.py --calls 200 --rounds 5 > "$R/tape_fp_cost.md" 2>&1
PYSPY=/tmp/site/bin/py-spy PROFILE_STEPS=20 timeout 300 bash bench/experiments/profile_tape.sh tape notape torch-fp > "$R/profile.log" 2>&1
RING_REPS=6 RING_STEPS=10 timeout 200 bash bench/gpu_suite.sh ring > "$R/suite-ring.log" 2>&1
tar -C "$R" -czf "$ROOT/results.tar.gz" . && rm -rf "$R"
