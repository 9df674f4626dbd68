"""The in-process agent: records (or, in replay mode, serves) a training process's collectives,
steps, batches, RNG and snapshots.

Loaded by ``boot/sitecustomize.py`` only when ``FSDP_REPLAY_MODE`` is set; it attaches once
``torch`` has been imported by the program itself. It never imports zarr: it writes the
checksummed spool (``fsdp_replay.trace.spool``) from a background thread.
"""
