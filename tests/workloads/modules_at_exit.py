"""Run a training script, then write which of this process's modules match a pattern.

For tests that must show a module was never imported in a recorded process (the agent's CUPTI
package on a CPU run): ``python modules_at_exit.py SCRIPT ARGS...`` with $MODULES_OUT (a JSON
file: the sorted module names) and $MODULES_MATCH (a substring). Only the process whose RANK is
0 (or unset) writes.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if os.environ.get("RANK", "0") == "0":
            pattern = os.environ["MODULES_MATCH"]
            found = sorted(m for m in sys.modules if pattern in m)
            with open(os.environ["MODULES_OUT"], "w") as f:
                json.dump(found, f)


if __name__ == "__main__":
    main()
