"""python -m rollout.server --model DIR [--address ipc:///tmp/x | tcp://127.0.0.1:PORT] [...]"""

import sys

from rollout.server.cli import main

sys.exit(main())
