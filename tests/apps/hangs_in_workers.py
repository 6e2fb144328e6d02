"""Handlers whose import never returns in a worker process (the supervisor imports them at once): a worker
process that never answers SIGTERM, as one hung in a C call would be."""

from __future__ import annotations

import multiprocessing
import time

from taskq import Handlers

if multiprocessing.current_process().name.startswith("taskq-worker"):
    time.sleep(600)

handlers = Handlers()
