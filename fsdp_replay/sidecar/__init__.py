"""The Kubernetes sidecar (not built yet): spool -> trace collection, eBPF uprobes on libnccl,
Prometheus metrics on the capture's own overhead. Never imports torch; the only importer of bcc.
"""
