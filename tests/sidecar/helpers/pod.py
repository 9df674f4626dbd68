"""A pod in miniature: the sidecar and the trainers in one process namespace (run it under
``unshare --pid --fork --mount-proc`` so that no other process of the machine is in it).

    pod.py SPEC_JSON

SPEC: {"sidecar": argv, "port": P, "groups": [[{"argv": [...], "env": {...}}, ...], ...],
"gap_s": seconds between groups (a torchrun restart), "timeout_s": how long to wait for the
sidecar to exit by itself}. Starts the sidecar, waits for /healthz, runs each group of trainers to
its end, then waits for the sidecar, scraping /metrics meanwhile. Prints one JSON line: the exit
codes, how long after the last trainer's end the sidecar exited, and the last scrape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request


def get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def main() -> int:
    spec = json.loads(sys.argv[1])
    port = spec["port"]
    sidecar = subprocess.Popen(spec["sidecar"])
    deadline = time.monotonic() + 60
    while get(port, "/healthz") != "ok\n":
        if sidecar.poll() is not None or time.monotonic() > deadline:
            print(json.dumps({"error": "the sidecar did not serve", "sidecar_rc": sidecar.poll()}))
            return 1
        time.sleep(0.05)
    trainer_rcs: list[int] = []
    alive_between_groups: list[bool] = []
    for i, group in enumerate(spec["groups"]):
        if i:
            time.sleep(spec.get("gap_s", 0))
            alive_between_groups.append(sidecar.poll() is None)
        procs = [subprocess.Popen(t["argv"], env={**os.environ, **t.get("env", {})}) for t in group]
        trainer_rcs += [p.wait() for p in procs]
    ended = time.monotonic()
    last = None
    deadline = ended + spec["timeout_s"]
    while sidecar.poll() is None and time.monotonic() < deadline:
        last = get(port, "/metrics") or last
        time.sleep(0.1)
    rc = sidecar.poll()
    exited = time.monotonic()
    if rc is None:
        sidecar.kill()
        sidecar.wait()
    print(
        json.dumps(
            {
                "sidecar_rc": rc,
                "trainer_rcs": trainer_rcs,
                "alive_between_groups": alive_between_groups,
                "exit_after_s": exited - ended,
                "metrics": last,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
