#!/usr/bin/env bash
# Session 22, the last call (under 300 s of device time left): CUPTI's detach between windows made
# the default (calls 22a/22b, scripts 20a/20b: the tests passed with FSDP_REPLAY_CUPTI_DETACH=1, meta-python-detach
# 0.939 and 0.912 of meta-python): the pinned-pool dump test and both CUPTI tests again, now with
# the default. The log goes straight to $OUT, so a cut run still reports.
set -uo pipefail
mkdir -p "$OUT"
bash bench/gpu_suite.sh none > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout $((250 - SECONDS)) python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_cupti_gpu.py tests/system/test_gpu.py \
  -k "nan_on_the_gpu_dumps_the_window or torch_profiler_inside or kernel_counts" > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests exit: $? at ${SECONDS}s" >> "$OUT/gpu-tests.log"
