#!/usr/bin/env bash
# Session 14's first GPU call: the flight recorder's device payloads land in pinned memory of their
# own (no host copy by the writer, the ring slot freed at the copy's event). 1. the payload ring's
# and the flight recorder's GPU tests; 2. one recorded run of the reference step with the default
# 256 MiB ring (drops? step times); 3. the healthy-step cost against metadata-only, 2 GiB ring.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/agent/test_payload_ring.py \
  "tests/system/test_gpu.py::test_a_nan_on_the_gpu_dumps_the_window_through_the_payload_ring_and_it_replays_bit_exact" \
  > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
ARGS="--steps 12 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
out=/tmp/win-default
timeout 120 python3 -m fsdp_replay record --out $out --payloads window:4 -- \
  python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS \
  > "$R/run-default-ring.log" 2>&1
python3 - "$out" > "$R/counters-default-ring.txt" 2>&1 <<'PY'
import json, sys
from fsdp_replay.trace.reader import Trace
r = Trace.open(sys.argv[1] + "/trace.zarr").rank(0)
c = r.attrs["end"]["counters"]
print(json.dumps({k: v for k, v in c.items() if "flight" in k or "drop" in k or "ring" in k or "blob" in k}, indent=1))
PY
grep -E "step [0-9]+ " "$R/run-default-ring.log" | tail -12 >> "$R/counters-default-ring.txt"
BENCH_CONFIGS=meta-python,window4-ring2g BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=25 \
  OUT=$R timeout 300 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
