"""The ``rank_start`` event: the first a rank writes (``docs/trace-format.md``).

What the process is (``capture.process_info``), the recording policy it runs under (what the
replay and ``inspect`` read to tell a payload that was never asked for from one that was lost),
the numerics key, and which fingerprint algorithms and native parts it uses.
"""

from __future__ import annotations

import time
from typing import Any

from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.fingerprint import native
from fsdp_replay.trace import schema


def rank_start_event(
    config: RecordConfig,
    info: dict[str, Any],
    numerics_key: dict[str, Any],
    t0_wall_ns: int,
    *,
    tape: bool,
    tape_error: str,
    window_bound: tuple[int, bool] | None,
    cxx_kernel: bool,
    cxx_tape: bool,
) -> dict[str, Any]:
    """The event; ``t0_wall_ns``: the wall-clock time of the agent's ``t_ns`` 0; ``window_bound``:
    the flight recorder's (bytes, sized from memory), or None without a window."""
    policy: dict[str, Any] = {
        "payloads": str(config.payloads),
        "payload_inputs": config.payload_inputs,
        "snapshot_every": config.snapshot_every,
        "sync_steps": config.sync_steps,
        "tape": tape,
        **({"tape_error": tape_error} if tape_error else {}),
        "tape_ops": config.tape_ops,
        "op_fingerprints": str(config.op_fingerprints),
        "cupti": str(config.cupti),
        "tape_payloads": None if config.tape_payloads is None else str(config.tape_payloads),
    }
    if window_bound:
        policy.update(window_bytes=window_bound[0], window_bytes_auto=window_bound[1])
    return {
        "type": schema.EV_RANK_START,
        "format_version": schema.FORMAT_VERSION,
        **info,
        "policy": policy,
        "start_ns": time.time_ns(),
        "t0_wall_ns": t0_wall_ns,
        "numerics": numerics_key,
        "fingerprint_algos": {
            "cpu": schema.FP_SK64 if native.available() else schema.FP_ZLIB64,
            "native_core": native.available(),
            "cxx_kernel": cxx_kernel,
            "cxx_tape": cxx_tape,
            "cpu_large": schema.FP_SK64,
            "cpu_large_min_bytes": schema.SK64_MIN_BYTES,
            "cuda": schema.FP_LIN64,
        },
    }
