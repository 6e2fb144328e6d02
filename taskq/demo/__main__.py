"""`python -m taskq.demo`: run the narrated demo (see `taskq.demo`)."""

import sys

from taskq.demo import main

sys.exit(main())
