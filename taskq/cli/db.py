"""`taskq db`: the Postgres schema and the purge of old idempotency records."""

from __future__ import annotations

import argparse

from taskq._core.durations import parse_duration
from taskq.cli.common import Commands, leaf, print_result, settings_of


def cmd_db_migrate(args: argparse.Namespace) -> int:
    from taskq._core.db import Database

    s = settings_of(args)
    applied = Database(s.database_url, schema=s.database_schema).migrate(namespace=s.namespace)
    print_result(args, applied, "\n".join(f"applied {m}" for m in applied) or "up to date")
    return 0



def cmd_db_purge(args: argparse.Namespace) -> int:
    from taskq._core.db import Database
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.store import IdempotencyStore

    s = settings_of(args)
    ttl = parse_duration(args.older_than).total_seconds()
    # Keys of tasks still in the DLQ are kept, whatever their age: a replay must find the key's record,
    # or a task whose effect already happened (through another copy) would run a second time.
    with DeadLetters(s) as dlq:
        keep = {r.idempotency_key for r in dlq.list(include_replayed=True) if r.idempotency_key}
    store = IdempotencyStore(
        Database(s.database_url, schema=s.database_schema), owner="taskq-cli", namespace=s.namespace
    )
    try:
        n = store.purge(ttl, keep=sorted(keep))
        workflows = store.purge_workflows(ttl)
        buckets, slots = store.purge_idle()
    finally:
        store.close()
    print_result(
        args,
        {"purged": n, "workflows": workflows, "idle_rate_buckets": buckets, "expired_slots": slots},
        f"purged {n} record(s) and {workflows} ended workflow(s) older than {args.older_than}, "
        f"{buckets} full rate bucket(s) and {slots} expired concurrency slot(s)",
    )
    return 0



def add_db(sub: Commands) -> None:
    """`taskq db migrate|purge`."""
    db = sub.add_parser("db", help="the Postgres store").add_subparsers(dest="sub", required=True)
    leaf(db, "migrate", cmd_db_migrate, "apply pending migrations")
    sp = leaf(db, "purge", cmd_db_purge, "delete completed and dead idempotency records older than the TTL")
    sp.add_argument("--older-than", default="7d", help="TTL, e.g. 7d (default), 12h")
