"""Builds the agent's one native part: ``fsdp_replay/agent/fingerprint/_fpcore.c``, a plain C library (no
Python API) that the agent loads with ctypes for one-pass sk64 fingerprints. Optional: without a
C compiler the install still succeeds and the agent uses its torch implementation (same values).
Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fsdp_replay.agent.fingerprint._fpcore",
            sources=["fsdp_replay/agent/fingerprint/_fpcore.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        )
    ]
)
