"""fsdp-replay: record a PyTorch FSDP job without touching its code, replay any rank alone.

Components (subpackages), each importable on its own:
- ``trace``: the versioned trace schema, the per-rank spool, the spool -> Zarr collector, readers.
  Imports no other component and never torch.
- ``agent``: the in-process recorder loaded by ``sitecustomize`` when enabled. Never imports zarr.
- ``sidecar``: out-of-process collection, eBPF uprobes on libnccl, metrics. Never imports torch.
- ``injector``: the Kubernetes mutating admission webhook. Never imports torch.
- ``replayer``: single-rank replay, verification and divergence reports.
"""

__version__ = "0.1.0"
