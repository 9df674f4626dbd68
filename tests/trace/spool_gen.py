"""A rank's spool written step by step, the way the agent writes it, with the cases that make a
collection touch rows an earlier one wrote: collectives completed late (after later ones: FSDP2's
deferred all-gathers), CUPTI kernel records delivered a flush late, payloads the flight recorder
held and a dump that wrote some of them, and a restarted process attempt. No torch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_replay.trace import schema, spool

FLIGHT = schema.FLIGHT_BLOB_BASE


class Trainer:
    """Writes one rank's spool (``SpoolWriter``), a step at a time (``step``)."""

    def __init__(self, spool_root: Path, rank: int, *, seed: int = 0, segment_bytes: int = 64 << 10) -> None:
        self.rank = rank
        self.rng = random.Random(seed * 100 + rank)
        self.w = spool.SpoolWriter(spool.rank_dir(spool_root, rank), rank, max_segment_bytes=segment_bytes)
        self.blob_id = 0
        self.seq = 0
        self.step_no = 0
        self.corr = 0
        self.kernel_names = 0
        self.late_kernel: list[Any] | None = None
        self.held: list[int] = []  # flight ids named so far
        self.start()

    # -- records ----------------------------------------------------------------------------
    def event(self, ev: dict[str, Any]) -> None:
        self.w.append(schema.KIND_EVENT, ev)

    def blob(self, raw: bytes) -> int:
        self.w.append(schema.KIND_BLOB, {"blob": self.blob_id, "nbytes": len(raw)}, raw)
        self.blob_id += 1
        return self.blob_id - 1

    def tensor(self, role: str, n: int, *, stored: bool = True, held: bool = False) -> list[Any]:
        data = np.arange(n, dtype=np.float32) * self.rng.random()
        blob = schema.NO_BLOB
        if held:
            blob = FLIGHT + len(self.held)
            self.held.append(blob)
        elif stored:
            raw = data.tobytes() if self.rng.random() < 0.8 else b"the same bytes every time" * 8
            blob = self.blob(raw)
        return [role, "float32", [n], self.rng.getrandbits(63), "zlib64", False, blob, "cpu"]

    def start(self) -> None:
        self.event(
            {
                "type": "rank_start",
                "format_version": schema.FORMAT_VERSION,
                "rank": self.rank,
                "world_size": 2,
                "local_rank": self.rank,
                "pid": 1000 + self.rank,
                "host": "node0",
                "argv": ["train.py"],
                "orig_argv": ["python", "train.py"],
                "executable": "/usr/bin/python",
                "cwd": "/work",
                "env": {},
                "versions": {"python": "3.11.7", "torch": "2.13.0+cpu"},
                "threads": {"intra_op": 1, "inter_op": 1},
                "determinism": {},
                "policy": {"payloads": "window:2"},
                "start_ns": 1_700_000_000_000_000_000,
                "fingerprint_algos": {"cpu": "zlib64"},
                "script": {"path": "/work/train.py", "sha256": "ab" * 32},
            }
        )
        self.event(
            {
                "type": "pg",
                "pg": 0,
                "name": "0",
                "ranks": [0, 1],
                "backend": "gloo",
                "size": 2,
                "group_rank": 0,
            }
        )
        self.blob_id = self.seq = self.corr = self.kernel_names = 0
        self.late_kernel = None

    def coll(self, seq: int, tensors: list[list[Any]]) -> None:
        ev = {"type": "coll", "seq": seq, "step": self.step_no, "micro": 0, "op": "_allgather_base_", "pg": 0}
        ev.update({"reduce_op": None, "root": None, "t_ns": 1000 * seq, "dur_ns": 7, "tensors": tensors})
        self.event(ev)

    def step(self) -> None:
        """One optimizer step: a batch, four collectives (one written after the next: late), RNG
        every other step, a module fingerprint, CUPTI rows (one delivered with the next step's),
        the step event."""
        s = self.step_no
        self.event(
            {
                "type": "batch",
                "step": s,
                "micro": 0,
                "index": s,
                "loader": 0,
                "structure": {"l": [{"T": 0}]},
                "tensors": [self.tensor("", 8)],
            }
        )
        late = self.rng.randrange(3)
        pending = None
        for k in range(4):
            held = self.rng.random() < 0.3
            ts = [self.tensor("i", 4, stored=False), self.tensor("o", 16, held=held)]
            if k == late:
                pending = (self.seq, ts)
            else:
                self.coll(self.seq, ts)
                if pending is not None:
                    self.coll(*pending)
                    pending = None
            self.seq += 1
        if s % 2:
            raw = json.dumps({"python": [s]}).encode()
            self.event(
                {"type": "rng", "step": s, "states": {"python": s, "torch": 3, "blob": self.blob(raw)}}
            )
        self.event(
            {
                "type": "mod",
                "step": s,
                "micro": 0,
                "idx": 0,
                "name": "layer",
                "kind": "fwd",
                "fp": s,
                "algo": "zlib64",
                "nonfinite": False,
            }
        )
        kernels = []
        for _ in range(3):
            self.corr += 1
            kernels.append([s, 0, self.seq - 1, self.corr, 10 * self.corr, 10 * self.corr + 5, 0, 7, 0])
        hold, self.late_kernel = self.late_kernel, kernels.pop(1)  # completes after the next flush
        if hold is not None:
            kernels.append(hold)
        names = [f"kernel_{self.kernel_names}"] if self.kernel_names == 0 else []
        self.event({"type": "cupti", "name_base": 0, "names": names, "kernels": kernels, "copies": []})
        self.kernel_names = 1
        self.event(
            {
                "type": "step",
                "step": s,
                "micro_steps": 1,
                "colls": 4,
                "params": [[s, False, "zlib64"]],
                "loss": [1.0 / (s + 1)],
                "t_ns": 1000 * self.seq,
            }
        )
        self.event({"type": "alive", "seq": self.seq, "step": s, "t_ns": 1000 * self.seq + 1})
        self.step_no += 1

    def dump_and_end(self) -> None:
        """A failure: the flight recorder writes some of what it held, then the end event."""
        written = [h for h in self.held if self.rng.random() < 0.5]
        for h in written:
            self.w.append(schema.KIND_BLOB, {"blob": h, "nbytes": 12}, b"held %07d" % (h - FLIGHT))
        self.event(
            {
                "type": "flight_dump",
                "reason": "nonfinite",
                "detail": "",
                "first_step": 0,
                "last_step": self.step_no,
                "snapshot_step": None,
                "blobs": len(written),
                "nbytes": 12 * len(written),
                "dropped": 0,
                "t_ns": 1000 * self.seq + 2,
            }
        )
        self.end()

    def end(self) -> None:
        if self.late_kernel is not None:
            self.event(
                {"type": "cupti", "name_base": 0, "names": [], "kernels": [self.late_kernel], "copies": []}
            )
            self.late_kernel = None
        self.event(
            {
                "type": "end",
                "reason": "exit",
                "steps": self.step_no,
                "colls": self.seq,
                "t_ns": 1000 * self.seq + 3,
                "counters": {},
            }
        )
        self.w.close()


def write_run(spool_root: Path, *, steps: int = 12, seed: int = 0) -> None:
    """Two ranks: rank 0 runs ``steps`` steps and fails (a flight dump); rank 1 is restarted after
    a third of them (its first attempt killed: no end event) and ends cleanly."""
    r0, r1 = Trainer(spool_root, 0, seed=seed), Trainer(spool_root, 1, seed=seed)
    for i in range(steps):
        r0.step()
        if i == steps // 3:
            r1.w.close()  # killed: a new process writes a new segment
            r1 = Trainer(spool_root, 1, seed=seed + 1)  # ids, numbers and steps start again
        r1.step()
    r0.dump_and_end()
    r1.end()
