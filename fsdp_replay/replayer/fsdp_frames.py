"""Which parameters feed a collective, read from the FSDP frames that issued it.

This reads FSDP1's and FSDP2's private frames and attributes (``fsdp_params``, ``_param_fqn``,
``flat_param._fqns``), so it will break on some torch upgrade: it does so here, in one small room,
and only costs a report its parameter names.
"""

from __future__ import annotations

import sys


def feeding_modules() -> list[str]:
    """Names of the parameters whose collective this is, found in the FSDP frames that issued it."""
    frame = sys._getframe(1)
    found: list[str] = []
    while frame is not None and not found:
        owner = frame.f_locals.get("self")
        fsdp_params = frame.f_locals.get("fsdp_params") or getattr(owner, "fsdp_params", None)
        if fsdp_params:  # FSDP2: FSDPParamGroup.unshard / post_backward
            for fp in fsdp_params:
                fqn = getattr(fp, "_param_fqn", None)
                info = getattr(fp, "_module_info", None)
                if fqn is None and info is not None:
                    fqn = f"{type(info.module).__name__}.{info.param_name}"
                found.append(str(fqn))
        flat = getattr(owner, "flat_param", None)
        if flat is not None and getattr(flat, "_fqns", None):  # FSDP1: FlatParamHandle
            found.extend(str(f) for f in flat._fqns)
        frame = frame.f_back  # type: ignore[assignment]
    return found[:50]
