"""The Kubernetes sidecar: spool -> trace collection (``ship``, signed with a key when given), eBPF uprobes on libnccl,
Prometheus metrics on the capture's own overhead. Never imports torch; the only importer of bcc.

The eBPF half (docs/sidecar-ebpf.md):

- ``discovery``: the pod's training processes (agent enabled in their environment, or libnccl
  mapped), polled; reports started / exited / newly mapped libraries, proc root a parameter.
- ``procfs``: reading /proc/<pid>/{cmdline,environ,maps,status,stat} of other processes, the path
  to a file they mapped as seen from our mount namespace (/proc/<pid>/root/...), and which pid
  namespace their pids are in.
- ``ebpf``: the per-call record (one definition for the BPF and Python sides), the NCCL API
  table with x86-64 argument locations, the BPF program built by a pure function, and the bcc
  probe (attach per library file or per process, kernel pid filter in the pod's pid namespace,
  ring or perf buffer, lost events counted). bcc is imported lazily, inside ``ebpf.probe`` only.

The daemon (docs/metrics.md):

- ``config``: ``SidecarConfig``, from ``FSDP_REPLAY_SIDECAR_*`` (and the agents' ``FSDP_REPLAY_OUT``).
- ``ranks``: one rank's spool records as running numbers (counts, the agent's recording cost).
- ``ncclstats``: the probe's NCCL calls counted per rank, op and communicator.
- ``processes``: CPU and memory of the training processes and of the sidecar (psutil).
- ``metrics``: the sidecar's own CollectorRegistry and its Collector over all of the above.
- ``exposition``: the registry rendered at most once a second per format, shared by all scrapers.
- ``server``: ``/metrics`` and ``/healthz`` (bounded threads and timeouts).
- ``ship``: spools -> the trace at the store, one ``Collector`` kept between collections.
- ``main``: the poll loop (discovery -> probes, spools -> rank states), signals, container-mode exit.
- ``cli``: ``fsdp-replay sidecar`` (every option a flag and a variable; hidden ``--print-bpf``).
"""
