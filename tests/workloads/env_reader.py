"""A program that reads its own environment, as jobs do: a data folder it requires
(``FSDPR_TEST_DATA_DIR``: a KeyError without it) and an optional credential
(``FSDPR_TEST_API_TOKEN``, which a recording redacts), then trains ``tiny_train.py``."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

data_dir = Path(os.environ["FSDPR_TEST_DATA_DIR"])
token = os.environ.get("FSDPR_TEST_API_TOKEN")  # the real job would call a service with it
print(f"data dir {data_dir} exists {data_dir.is_dir()}; token {'set' if token else 'unset'}", flush=True)
sys.argv = [str(Path(__file__).with_name("tiny_train.py")), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
