#!/usr/bin/env bash
# Session 16's first GPU call: the C++ hook's keep test (15d's), then where CUPTI's cost goes
# (--cupti always against metadata-only) and where the flight recorder's remaining cost goes
# (window:4 with the C++ hook keeping): py-spy on the rank (native frames, 100 Hz, 12 s past
# step 14 of 90-step runs) and the trace's per-step CPU by part.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/agent/test_cxx_tape.py tests/agent/test_payload_ring.py > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
ARGS="--steps 90 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
PYSPY=$(find /tmp/site -name py-spy -type f -perm -u+x | head -1)
for run in "cupti:--payloads none --cupti always" "meta:--payloads none" "window4:--payloads window:4"; do
  tag=${run%%:*} mode=${run#*:}
  LOG=$R/run-$tag.log
  timeout 240 python3 -m fsdp_replay record --out /tmp/run-$tag $mode -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS > "$LOG" 2>&1 &
  for _ in $(seq 1 180); do grep -q "^step 14 " "$LOG" && break; sleep 1; done
  runner=$(pgrep -f "^[^ ]*python[0-9.]* -m torch.distributed.run" | head -1)
  pid=$(pgrep -P "$runner" -f examples/train_fsdp.py | head -1)
  echo "$mode: torchrun $runner, rank $pid" >> "$R/pyspy.log"
  "$PYSPY" record --pid "$pid" --duration 12 --rate 100 --idle --native --threads --format raw \
    -o "$R/pyspy-$tag.txt" >> "$R/pyspy.log" 2>&1
  wait
  python3 -m fsdp_replay inspect /tmp/run-$tag/trace.zarr > "$R/inspect-$tag.txt" 2>&1
  python3 bench/experiments/profile_summary.py "$R/pyspy-$tag.txt" > "$R/summary-$tag.txt" 2>&1
  gzip "$R/pyspy-$tag.txt"
done
