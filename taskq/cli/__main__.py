"""`python -m taskq.cli`: the `taskq` command."""

import sys

from taskq.cli import main

sys.exit(main())
