"""Post-mortem analysis of traces, from what they recorded alone: numpy, never torch.

``nonfinite`` (``fsdp-replay nan``), ``desync``, ``diff`` (trace against trace), ``summary``
(``inspect``), on shared ``columns``; ``payloads`` decodes tensor bytes and measures how far two
are apart; ``plots`` draws results. It reads traces only through ``fsdp_replay.trace``.
"""
