"""`python -m taskq.cli`: the `taskq` command."""

from taskq.cli import run

run()
