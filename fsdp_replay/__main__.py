import sys

from fsdp_replay.cli import main

sys.exit(main())
