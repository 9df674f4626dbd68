#!/usr/bin/env bash
# Session 15's second GPU call: call a's py-spy profile picked a DataLoader worker (forked from the
# rank, same command line); this one profiles the rank itself (window:4, then metadata-only) (the child of torchrun), once the
# run has printed step 14, for 12 s, and keeps the trace's per-step CPU by part (inspect --json).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ARGS="--steps 90 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
PYSPY=$(find /tmp/site -name py-spy -type f -perm -u+x | head -1)
for run in "window4:--payloads window:4" "meta:--payloads none --no-cxx-kernel"; do
  tag=${run%%:*} mode=${run#*:}
  LOG=$R/run-$tag.log
  timeout 240 python3 -m fsdp_replay record --out /tmp/run-$tag $mode -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS > "$LOG" 2>&1 &
  for _ in $(seq 1 180); do grep -q "^step 14 " "$LOG" && break; sleep 1; done
  runner=$(pgrep -f "^[^ ]*python[0-9.]* -m torch.distributed.run" | head -1)
  pid=$(pgrep -P "$runner" -f examples/train_fsdp.py | head -1)
  echo "$mode: torchrun $runner, rank $pid: $(tr '\0' ' ' < /proc/$pid/cmdline)" >> "$R/pyspy.log"
  "$PYSPY" record --pid "$pid" --duration 12 --rate 250 --idle --native --threads --format raw \
    -o "$R/pyspy-$tag.txt" >> "$R/pyspy.log" 2>&1
  wait
  python3 -m fsdp_replay inspect /tmp/run-$tag/trace.zarr --json > "$R/inspect-$tag.json" 2>> "$R/pyspy.log"
  python3 -m fsdp_replay inspect /tmp/run-$tag/trace.zarr > "$R/inspect-$tag.txt" 2>&1
done
