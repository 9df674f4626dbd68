#!/usr/bin/env bash
# Session 23's first call: (1) the flight recorder's NaN dump through the pinned pool with CUPTI's
# detach as the default (22c ran out of time before it); (2) where the flight recorder's remaining
# cost goes now (pinned pool, detach): py-spy on the rank (native frames, 100 Hz, 12 s past step 14
# of 90-step runs) for meta-python and window4, and the trace's per-step CPU by part; (3) the bench
# of window4 over meta-python with the rest of the call (bench_record writes after each whole
# repetition, so a cut run still reports).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_gpu.py -k nan_on_the_gpu_dumps_the_window > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $? at ${SECONDS}s" >> "$R/gpu-tests.log"
ARGS="--steps 90 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
PYSPY=$(find /tmp/site -name py-spy -type f -perm -u+x | head -1)
for run in "meta-python:--payloads none --no-cxx-kernel" "window4:--payloads window:4"; do
  tag=${run%%:*} mode=${run#*:}
  LOG=$R/run-$tag.log
  timeout 120 python3 -m fsdp_replay record --out /tmp/run-$tag $mode -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS > "$LOG" 2>&1 &
  for _ in $(seq 1 100); do grep -q "^step 14 " "$LOG" && break; sleep 1; done
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
python3 bench/experiments/profile_agent_frames.py "$R/pyspy-meta-python.txt.gz" "$R/pyspy-window4.txt.gz" \
  > "$R/profile-agent-frames.txt" 2>&1
echo "profiles done at ${SECONDS}s" >> "$R/pyspy.log"
left=$((580 - SECONDS))
BENCH_CONFIGS=meta-python,window4 BENCH_REPS=6 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
