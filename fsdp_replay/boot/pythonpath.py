"""The one PYTHONPATH rule that enables the agent, shared by ``fsdp-replay record`` and the injector.

Our ``sitecustomize``'s folder first, then a folder holding only the ``fsdp_replay`` package (never a
whole site-packages, which would reorder the program's own imports), then the program's own
PYTHONPATH, unchanged. Applying the rule to a value it produced changes nothing, so a re-injected
pod or a nested ``record`` keeps one copy of each entry.
"""

from __future__ import annotations

import os
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "site"
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def agent_pythonpath(site_dir: str, lib_dir: str, existing: str | None, *, sep: str = os.pathsep) -> str:
    """``site_dir``, ``lib_dir``, then ``existing`` without any copy of those two (order kept)."""
    ours = [site_dir, lib_dir]
    rest = [p for p in (existing or "").split(sep) if p and p not in ours]
    return sep.join(ours + rest)
