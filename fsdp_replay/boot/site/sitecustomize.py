"""fsdp-replay's sitecustomize: does nothing unless FSDP_REPLAY_MODE (or FSDP_REPLAY_DEPS) is set.

Put on PYTHONPATH by ``fsdp-replay record`` and by the Kubernetes injector. It must stay cheap
(no imports beyond ``os`` and ``sys`` when disabled) and must still run the ``sitecustomize``
that it shadows, if the program's environment had one.

``FSDP_REPLAY_DEPS`` (set in replay Jobs, ``fsdp_replay/injector/job.py``) names the replay
payload's library folders, one per CPython version (``DEPS/cp312``): this interpreter's is added
*after* the program's own site-packages, so the program keeps the numpy (and everything else) it
was recorded with, and only the libraries its image lacks (zarr, numcodecs, ...) come from ours.
"""

import os
import sys


def _chain() -> None:
    """Run the next sitecustomize on sys.path (the one ours shadows), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _deps() -> None:
    root = os.environ.get("FSDP_REPLAY_DEPS")
    if not root:
        return
    folder = os.path.join(root, f"cp{sys.version_info[0]}{sys.version_info[1]}")
    if os.path.isdir(folder) and folder not in sys.path:
        import site

        site.addsitedir(folder)  # appended, with its .pth files, as a site-packages would be


def _main() -> None:
    _deps()
    mode = os.environ.get("FSDP_REPLAY_MODE", "off")
    if mode not in ("", "off"):
        try:
            from fsdp_replay.boot.attach import activate

            activate()
        except Exception as e:
            if mode == "replay":  # a replay never runs the program for real: fail closed
                sys.stderr.write(f"fsdp-replay: cannot replay: the agent could not start: {e!r}\n")
                sys.stderr.flush()
                os._exit(3)
            sys.stderr.write(f"fsdp-replay: agent not started: {e!r}\n")  # recording: never stop it
    _chain()


_main()
