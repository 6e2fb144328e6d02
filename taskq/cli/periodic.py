"""`taskq periodic`: the periodic tasks of a namespace."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime

from taskq.cli.common import Commands, leaf, print_result, settings_of


def cmd_periodic_list(args: argparse.Namespace) -> int:
    """The periodic tasks of the namespace: schedule, last slot staged, next slot."""
    from taskq._core.db import Database
    from taskq._core.store import Store
    from taskq.consumer.handlers import load
    from taskq.consumer.periodic import schedule_from_text

    s = settings_of(args)
    database = Database(s.database_url, schema=s.database_schema)
    try:
        rows = {r["name"]: dict(r) for r in Store(database).periodic_list(s.namespace)}
    finally:
        database.close()
    if args.handlers:
        sys.path.insert(0, os.getcwd())
        for spec in load(args.handlers).periodic_tasks:
            row = rows.setdefault(spec.name, {"name": spec.name, "last_slot": None, "staged_at": None})
            row.update(schedule=spec.schedule.text, catch_up=spec.catch_up, task_type=spec.task_type)
    now = datetime.now(UTC)
    out = []
    for name in sorted(rows):
        row = rows[name]
        last = row.get("last_slot")
        nxt = schedule_from_text(row["schedule"]).next_after(max(now, last) if last else now)
        out.append(
            {
                "name": name,
                "schedule": row["schedule"],
                "catch_up": row["catch_up"],
                "last_slot": last.isoformat() if last else None,
                "next_slot": nxt.isoformat(),
            }
        )
    text = "\n".join(
        f"{r['name']:<30} {r['schedule']:<16} last {r['last_slot'] or 'never':<32} next {r['next_slot']}"
        for r in out
    )
    print_result(args, out, text or "no periodic tasks")
    return 0


def add_periodic(sub: Commands) -> None:
    """`taskq periodic list`."""
    periodic = sub.add_parser("periodic", help="periodic tasks").add_subparsers(dest="sub", required=True)
    sp = leaf(periodic, "list", cmd_periodic_list, "each periodic task's schedule, last and next slot")
    sp.add_argument(
        "handlers", nargs="?", metavar="MODULE:ATTR", help="also list tasks no scheduler has run yet"
    )
