"""Run inside the sidecar image: uprobes on ncclAllReduce in a process of the host (``--pid=host``).

    python3 probe_in_container.py PID CALLS

Attaches through /proc/PID/root/... (the library as the host process maps it), prints one JSON
line when attached, waits for a line on stdin (the host's loop has finished), drains, and prints
one JSON line with what it saw. Only the project's probe code and the image's bcc are used.
"""

import json
import sys
from collections import Counter

from fsdp_replay.sidecar.ebpf import nccl
from fsdp_replay.sidecar.ebpf.probe import Event, Probe


def main() -> int:
    pid, calls = int(sys.argv[1]), int(sys.argv[2])
    seen = bytearray(calls)  # the loop passes its index as `count`
    pids: Counter[int] = Counter()
    first: dict[str, int] = {}

    def on_event(e: Event) -> None:
        seen[e.args["count"]] += 1
        pids[e.pid] += 1
        if not first:
            first.update({k: int(v) for k, v in e.args.items()}, ret=e.ret)

    with Probe(nccl.by_name("ncclAllReduce"), on_event) as probe:
        (attachment,) = probe.track(pid)
        print(json.dumps({"attached": attachment.path, "probed": attachment.probed}), flush=True)
        sys.stdin.readline()
        probe.drain()
        stats = probe.stats()
    print(
        json.dumps(
            {
                "transport": probe.transport,
                "entries": stats.entries,
                "delivered": stats.delivered,
                "lost": stats.lost,
                "exactly_once": seen.count(1),
                "pids": {str(k): v for k, v in pids.items()},
                "first": first,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
