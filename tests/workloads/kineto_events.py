"""Kineto's events as the profiler workloads read them, the same on every torch they run with."""

from __future__ import annotations

from typing import Any


def activity(e: Any) -> str:
    """Kineto's activity type of an event ("kernel", "gpu_memcpy", ...); by device and name where
    this torch's events do not say (torch 2.11's have no ``activity_type``)."""
    kind = getattr(e, "activity_type", None)
    if kind is not None:
        return str(kind())
    if str(e.device_type()).endswith("CUDA"):
        name = e.name()
        return (
            "gpu_memcpy"
            if name.startswith("Memcpy")
            else "gpu_memset"
            if name.startswith("Memset")
            else "kernel"
        )
    return "cpu"
