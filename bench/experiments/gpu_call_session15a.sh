#!/usr/bin/env bash
# Prepared in session 14 for the next session's first GPU call: where the flight recorder's
# remaining cost goes on the reference step (session 14: window4 1.334 [1.278, 1.349] of
# metadata-only past its warm-up, 20 ms of hook CPU a step more).
# 1. The bench with the hooks' CPU by part (agent_cpu_<part>_ns: collectives, tape, payloads,
#    snapshots, cxx), window4 against meta-python past the window's warm-up.
# 2. A py-spy profile (all threads, idle included, native frames) of a window:4 rank in steady
#    state: started once the run has printed step 14, for 10 s.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ARGS="--steps 60 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
LOG=$R/run-window4-profiled.log
timeout 200 python3 -m fsdp_replay record --out /tmp/run-profiled --payloads window:4 -- \
  python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS > "$LOG" 2>&1 &
for _ in $(seq 1 150); do grep -q "^step 14 " "$LOG" && break; sleep 1; done
pid=""
for p in $(pgrep -f "examples/train_fsdp.py"); do
  tr '\0' ' ' < /proc/$p/cmdline | grep -q "torch.distributed.run" || pid=$p
done
PYSPY=$(find /tmp/site -name py-spy -type f -perm -u+x | head -1)
echo "rank pid: $pid, py-spy: $PYSPY" > "$R/pyspy.log"
if [ -n "$pid" ]; then
  "$PYSPY" record --pid "$pid" --duration 10 --rate 200 --idle --native --threads --format raw -o "$R/pyspy-native.txt" >> "$R/pyspy.log" 2>&1 \
    || "$PYSPY" record --pid "$pid" --duration 10 --rate 200 --idle --threads --format raw -o "$R/pyspy.txt" >> "$R/pyspy.log" 2>&1
fi
wait
BENCH_CONFIGS=meta-python,window4 BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=36 BENCH_WARMUP=12 \
  OUT=$R timeout 330 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
