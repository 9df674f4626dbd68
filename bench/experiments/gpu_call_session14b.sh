#!/usr/bin/env bash
# Session 14's second GPU call (a diagnosis): call a's window4 step is 430 ms against 105 ms for
# metadata-only, with 34 ms of agent CPU a step and nothing dropped. Per-step times of three runs
# of the reference step (metadata-only; window:4; window:4 with no snapshot after step 0's) and a
# py-spy profile (all threads, idle included, native frames) of the window:4 rank in steady state.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ARGS="--steps 18 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: print(f"{time.time():.3f} {line}", end="")'; }
run() {  # name, record args...
  local name=$1; shift
  timeout 150 python3 -m fsdp_replay record --out /tmp/run-$name "$@" -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS 2>&1 | stamp > "$R/run-$name.log"
}
run meta --payloads none --no-cxx-kernel
run window4-nosnap --payloads window:4 --snapshot-every 1000
run window4 --payloads window:4 &
sleep 45
pid=$(pgrep -f "examples/train_fsdp.py" | while read p; do if ! grep -q "torch.distributed.run" /proc/$p/cmdline; then echo $p; fi; done | tail -1)
PYSPY=$(find /tmp/site -name py-spy -type f -perm -u+x | head -1)
echo "rank pid: $pid, py-spy: $PYSPY" > "$R/pyspy.log"
"$PYSPY" record --pid "$pid" --duration 12 --rate 250 --idle --native --threads --format raw -o "$R/pyspy-native.txt" >> "$R/pyspy.log" 2>&1 \
  || "$PYSPY" record --pid "$pid" --duration 12 --rate 250 --idle --threads --format raw -o "$R/pyspy.txt" >> "$R/pyspy.log" 2>&1
wait
for n in meta window4-nosnap window4; do
  python3 - /tmp/run-$n "$R/run-$n.log" > "$R/summary-$n.txt" 2>&1 <<'PY'
import json, re, sys
from fsdp_replay.trace.reader import Trace
r = Trace.open(sys.argv[1] + "/trace.zarr").rank(0)
c = r.attrs["end"]["counters"]
print(json.dumps({k: v for k, v in c.items() if "flight" in k or "drop" in k or "blob" in k or "tape" in k}))
ts = [(int(m.group(2)), float(m.group(1))) for m in (re.match(r"([0-9.]+) step (\d+) ", l) for l in open(sys.argv[2])) if m]
print("step ms:", [(s, round((t - t0) * 1000)) for (s, t), (_, t0) in zip(ts[1:], ts[:-1])])
PY
done
