"""eBPF uprobes on NCCL (and any other library's functions), through bcc.

``records`` (the per-call record, one definition for both sides), ``signatures`` (C signatures
and where x86-64 puts each argument), ``nccl`` (the NCCL API table), ``programs`` (the BPF C text,
built by a pure function), ``elf`` (symbol lookup), ``probe`` (attach, pid filter, delivery),
``events`` (what the probe hands out: decoded records, counters, attachments).
Only ``probe`` imports bcc, and only inside its functions: everything else works without root.
"""
