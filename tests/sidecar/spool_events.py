"""Complete spool events (every key the schema requires), for synthetic spools in the sidecar tests."""

from __future__ import annotations

from typing import Any

from fsdp_replay.trace import schema


def rank_start(rank: int, t0_wall_ns: int, world_size: int = 2) -> dict[str, Any]:
    return {
        "type": schema.EV_RANK_START,
        "format_version": schema.FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "local_rank": rank,
        "pid": 1000 + rank,
        "host": "test",
        "argv": ["train.py"],
        "orig_argv": ["python", "train.py"],
        "executable": "python",
        "cwd": "/",
        "env": {},
        "versions": {},
        "threads": {},
        "determinism": {},
        "script": None,
        "policy": {},
        "start_ns": t0_wall_ns,
        "fingerprint_algos": {},
        "t0_wall_ns": t0_wall_ns,
    }


def coll(seq: int, op: str, t_ns: int, dur_ns: int, step: int = 0) -> dict[str, Any]:
    return {
        "type": schema.EV_COLLECTIVE,
        "seq": seq,
        "step": step,
        "micro": 0,
        "op": op,
        "pg": 0,
        "reduce_op": None,
        "root": None,
        "t_ns": t_ns,
        "dur_ns": dur_ns,
        "tensors": [],
    }


def step(index: int, t_ns: int, cpu_ns: tuple[int, int] | None) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": schema.EV_STEP,
        "step": index,
        "micro_steps": 1,
        "colls": 0,
        "params": [],
        "loss": [],
        "t_ns": t_ns,
    }
    if cpu_ns is not None:
        ev["cpu_ns"] = list(cpu_ns)
    return ev


def end(t_ns: int, steps: int, colls: int, **counters: int) -> dict[str, Any]:
    return {
        "type": schema.EV_END,
        "reason": "exit",
        "steps": steps,
        "colls": colls,
        "t_ns": t_ns,
        "counters": counters,
    }


def stuck(seq: int, op: str, t_ns: int, waited_ns: int) -> dict[str, Any]:
    return {
        "type": schema.EV_STUCK,
        "seq": seq,
        "step": 0,
        "op": op,
        "pg": 0,
        "t_ns": t_ns,
        "waited_ns": waited_ns,
    }


def alive(seq: int, t_ns: int) -> dict[str, Any]:
    return {"type": schema.EV_ALIVE, "seq": seq, "step": 0, "t_ns": t_ns}


def agent_error() -> dict[str, Any]:
    return {"type": schema.EV_AGENT_ERROR, "where": "test", "message": "boom", "traceback": ""}
