"""One gloo rank that records a collective, then blocks: its main thread in ``time.sleep`` (or in
``threading.Event.wait`` with ``--in-event-wait``), a second thread named ``waiter`` in ``Event.wait``.

The dump-request tests (``tests/agent/test_state_dump.py``) ask it for its state while it is
blocked; the lines marked ``BLOCKED-MAIN`` are where its main thread must be found.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist


def block(event: bool) -> None:
    if event:
        threading.Event().wait(600)  # BLOCKED-MAIN-EVENT
    else:
        time.sleep(600)  # BLOCKED-MAIN-SLEEP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--in-event-wait", action="store_true", help="block in Event.wait instead of time.sleep")
    args = p.parse_args()
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)  # starts the agent's writer
    waiter = threading.Thread(target=threading.Event().wait, args=(600,), name="waiter", daemon=True)
    waiter.start()
    print("blocking", flush=True)
    block(args.in_event_wait)


if __name__ == "__main__":
    main()
