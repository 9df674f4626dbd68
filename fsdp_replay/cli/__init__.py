"""The one command line, ``fsdp-replay``: a module per subcommand, each with ``register(sub)``.

``main`` (cli/main.py) builds the parser and maps errors to exit codes; ``launch`` runs a command
with the agent enabled; ``render`` prints results; ``watchdog`` stops a job whose fsdp-replay
command died.
"""

from fsdp_replay.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
