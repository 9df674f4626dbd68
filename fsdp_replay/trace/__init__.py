"""The trace: versioned schema, per-rank spool, spool -> Zarr collector and readers.

This package imports no other fsdp-replay component and never torch, so that the sidecar,
the collector and any reader can use it on machines without PyTorch.
"""
