"""Start the agent from ``sitecustomize``: cheap when off, attached once the program imports torch.

Importing torch ourselves at interpreter start would cost every Python process started with the
agent's environment (torchrun's launcher, helper scripts) a second or more, so instead a one-shot
import hook waits for the program's own ``import torch`` and attaches right after it.

In record mode each process that attaches first leaves a small marker in the run folder
(``mark_attached``): a rank's spool starts only with its first record, so a job that dies before
that (a bad rendezvous address, an error right after ``import torch``) would otherwise leave no
sign that its processes ever ran with the agent.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any, NoReturn

from fsdp_replay.agent.after_import import AfterImport

log = logging.getLogger(__name__)
_state: dict[str, Any] = {}  # the one attached agent of this process (tests reach it here)


EXIT_BAD_INPUT = 3


def refuse_replay(why: str, report_dir: str | None = None, rank: int | None = None) -> NoReturn:
    """End a process that was asked to replay and cannot: never run the program for real.

    A replayed program that went on without the agent would run as a real rank, joining whatever
    rendezvous its environment names (in a cluster, possibly a live job's). Writes the report
    (status ``unusable``) when the report folder is known, says why on stderr, exits with 3.
    """
    sys.stderr.write(f"fsdp-replay: cannot replay: {why}\n")
    if report_dir:
        try:
            import json
            from pathlib import Path

            from fsdp_replay.trace.layout import REPORT_JSON, atomic_write

            out = Path(report_dir)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write(out / REPORT_JSON, json.dumps({"status": "unusable", "reason": why, "rank": rank}))
        except Exception as e:  # the exit below matters more than the report
            sys.stderr.write(f"fsdp-replay: could not write the replay report: {e!r}\n")
    sys.stderr.flush()
    os._exit(EXIT_BAD_INPUT)


def _describe(e: BaseException) -> str:
    """One line for a failure to attach: our errors name their file; anything else is a bug."""
    from fsdp_replay.errors import FsdpReplayError

    return str(e) if isinstance(e, FsdpReplayError) else f"internal error: {e!r}"


def config_from_env(env: Any = None) -> Any:
    """The config of the mode ``FSDP_REPLAY_MODE`` names: a RecordConfig, a ReplayConfig, or None."""
    env = os.environ if env is None else env
    mode = env.get("FSDP_REPLAY_MODE", "off") or "off"
    if mode == "record":
        from fsdp_replay.agent.config import RecordConfig

        return RecordConfig.from_env(env)
    if mode == "replay":
        from fsdp_replay.replayer.config import ReplayConfig

        return ReplayConfig.from_env(env)
    if mode != "off":
        from fsdp_replay.errors import ConfigError

        raise ConfigError(f"FSDP_REPLAY_MODE={mode!r}: expected off, record or replay")
    return None


def activate() -> None:
    """Called by sitecustomize when FSDP_REPLAY_MODE is set. In record mode it never raises and
    never stops the program; in replay mode any failure to attach ends the process (exit 3)."""
    replaying = os.environ.get("FSDP_REPLAY_MODE") == "replay"
    try:
        config = config_from_env()
    except Exception as e:  # a bad option must not stop the program from starting
        if replaying:
            refuse_replay(f"bad replay settings: {_describe(e)}", os.environ.get("FSDP_REPLAY_REPORT"))
        log.warning("fsdp-replay: agent disabled: %s", e)
        return
    if config is None:
        return
    if "multiprocessing-fork" in " ".join(sys.argv):
        # A multiprocessing child (spawn/forkserver): a DataLoader worker, whose parent is the rank,
        # or a rank that torch.multiprocessing.spawn started, which is not recorded: say so where it
        # joins a process group, so that `record` can tell the user why nothing was recorded.
        if config.mode == "record":
            sys.meta_path.insert(0, AfterImport("torch", lambda _m: _flag_spawned_rank(str(config.out))))
        return
    if replaying and not (config.live and "RANK" not in os.environ):  # not torchrun's launcher
        _quiet_start_up()
    redacted = str(getattr(config, "redacted_env", "") or "") if replaying else ""
    if redacted:
        from fsdp_replay.replayer import env_watch  # before the program's first line reads one

        env_watch.watch(redacted.split(","))

    def on_torch(_module: types.ModuleType) -> None:
        attach(config)

    if "torch" in sys.modules:
        attach(config)
    else:
        sys.meta_path.insert(0, AfterImport("torch", on_torch))


def _quiet_start_up() -> None:
    """Until the replay has started (``attach`` gives it back), Ctrl-C ends this process the way
    SIGINT ends a program that does not catch it: at once and silently (``replay`` says, in one
    line, that it was stopped before it could report). Python's own handler would print a
    KeyboardInterrupt traceback from whatever the start-up was importing, torch most often. A
    handler of anyone else's (SIG_IGN in a background job) is left alone."""
    import signal

    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _state["quiet_start_up"] = True
    except ValueError:  # not the main thread: nothing to quiet, nothing to give back
        pass


def _end_quiet_start_up() -> None:
    """Ctrl-C is the program's again (a KeyboardInterrupt, which the replay reports as stopped),
    unless the program set a handler of its own meanwhile."""
    import signal

    if not _state.pop("quiet_start_up", False):
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # attached from another thread: the program keeps the silent default
        pass


def _flag_spawned_rank(out: str) -> None:
    """In a multiprocessing child: leave an attach marker saying ``SPAWNED_RANK`` when it calls
    ``torch.distributed.init_process_group`` (a DataLoader worker never does), then go on."""
    try:
        import torch.distributed as dist

        from fsdp_replay.trace.layout import SPAWNED_RANK

        original = dist.init_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            mark_attached(out, error=SPAWNED_RANK)
            return original(*args, **kwargs)

        dist.init_process_group = init_process_group
    except Exception as e:  # recording must never stop the program
        log.debug("fsdp-replay: could not watch a multiprocessing child: %r", e)


def mark_attached(out: str, error: str | None = None) -> None:
    """Write this process's attach marker (``RUN/spool/attached/<pid>-<host>.json``, atomically):
    its pid, host, redacted argv, the ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` it was given (None where
    unset), the time, and ``error`` when the agent failed to attach. Never raises: a marker that
    cannot be written costs only ``record``'s explanation of a run that recorded nothing."""
    try:
        import json
        import platform
        import time

        from fsdp_replay.trace import redact_key
        from fsdp_replay.trace.layout import atomic_write, attached_marker
        from fsdp_replay.trace.redact import redact_argv

        def env_int(name: str) -> int | str | None:
            v = os.environ.get(name)
            return int(v) if v is not None and v.strip().isdigit() else v

        host = platform.node()
        path = attached_marker(out, os.getpid(), host)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {
            "pid": os.getpid(),
            "host": host,
            "argv": redact_argv(sys.argv, redact_key.from_env()),
            "rank": env_int("RANK"),
            "local_rank": env_int("LOCAL_RANK"),
            "world_size": env_int("WORLD_SIZE"),
            "time": time.time(),
        }
        if error is not None:
            doc["error"] = error
        atomic_write(path, json.dumps(doc) + "\n")
    except Exception as e:  # recording must never stop the program
        log.debug("fsdp-replay: could not write the attach marker: %r", e)


def attach(config: Any) -> Any:
    """Install the agent for ``config.mode``; returns it (or None after a logged failure)."""
    if "agent" in _state:
        return _state["agent"]
    if config.mode == "record":
        mark_attached(str(config.out))
    try:
        if config.mode == "record":
            import atexit

            from fsdp_replay.agent.hooks import Hooks
            from fsdp_replay.agent.recorder import Recorder

            agent: Any = Recorder(config)
            hooks = Hooks(agent)
            hooks.install()
            agent.install_tape()
            agent.install_sigterm()
            if agent.ops is not None:  # --op-fingerprints with step 0: the window opens now
                agent.ops.at_step(0)
            atexit.register(agent.finish)
            _state.update(agent=agent, hooks=hooks)
            return agent
    except Exception as e:
        log.warning("fsdp-replay: agent failed to attach, the program runs unrecorded: %r", e)
        mark_attached(str(config.out), error=repr(e))
        return None
    if config.mode == "replay":
        if config.live and "RANK" not in os.environ:
            return None  # torchrun's launcher in an all-rank replay: only its workers replay
        try:
            from fsdp_replay.replayer.agent import attach_replay

            agent = attach_replay(config)
        except Exception as e:
            refuse_replay(_describe(e), config.report, config.rank)
        _state.update(agent=agent)
        _end_quiet_start_up()
        return agent
    return None
