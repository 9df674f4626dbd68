"""Fingerprint values still on the device, and host views of tensor bytes.

The writer thread resolves a ``Pending`` (it waits for its CUDA event) when it encodes an event,
so the training thread never synchronises with the device; it is all the writer needs from the
fingerprint code.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def host_buffer(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a contiguous CPU tensor's bytes (keep ``t`` alive while used)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return (ctypes.c_char * n).from_address(t.data_ptr())


# Events the writer thread waits on are created with blocking=True: it sleeps until the device
# gets there instead of spinning a core (cudaEventBlockingSync); nothing else waits on them.


class Pending:
    """A value still on the device; ``value()`` waits for its event (writer thread only)."""

    __slots__ = ("_combine", "_event", "_host")

    def __init__(self, host: Any, event: Any, combine: Any) -> None:
        self._host = host
        self._event = event
        self._combine = combine

    def value(self) -> Any:
        if self._event is not None:
            self._event.synchronize()
        return self._combine(self._host)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_values(t: torch.Tensor) -> Any:
    """A small tensor's values as a list: now on the CPU, as a ``Pending`` on a device."""
    if t.device.type == "cpu":
        return t.detach().double().tolist()
    host = torch.empty(t.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(t.detach().double(), non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record()
    return Pending(host, event, lambda h: h.tolist())
