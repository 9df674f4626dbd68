#!/usr/bin/env bash
# Session 13's fourth GPU call (a diagnosis): why the flight recorder drops every payload of the
# reference step (call c: 864 dropped with a bound of ~30 GiB). One recorded run with the default
# payload ring (256 MiB) and one with a 2 GiB ring; each run's flight counters and drop events.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ grep -E "MemTotal|MemAvailable" /proc/meminfo; for f in memory.max memory.current; do echo "$f: $(cat /sys/fs/cgroup/$f 2>&1)"; done; } > "$R/memory.txt"
ARGS="--steps 12 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
for ring in 0 2147483648; do
  out=/tmp/win-$ring
  if [ "$ring" != 0 ]; then export FSDP_REPLAY_PAYLOAD_RING_BYTES=$ring; fi
  timeout 200 python3 -m fsdp_replay record --out $out --payloads window:4 -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS \
    > "$R/run-$ring.log" 2>&1
  python3 - "$out" > "$R/counters-$ring.txt" 2>&1 <<'PY'
import json, sys
from fsdp_replay.trace.reader import Trace
r = Trace.open(sys.argv[1] + "/trace.zarr").rank(0)
c = r.attrs["end"]["counters"]
print(json.dumps({k: v for k, v in c.items() if "flight" in k or "drop" in k or "ring" in k or "blob" in k}, indent=1))
print("attrs", sorted(r.attrs))
print(json.dumps({k: v for k, v in r.attrs.items() if k in ("start", "rank_start", "policy", "flight_dumps")}, default=str)[:3000])
PY
  grep -E "step [0-9]+ " "$R/run-$ring.log" | tail -5 >> "$R/counters-$ring.txt"
done
