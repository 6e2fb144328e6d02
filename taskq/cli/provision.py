"""`taskq topics` and `taskq schemas`: what a namespace needs before its first task."""

from __future__ import annotations

import argparse
from pathlib import Path

from taskq.cli.common import Commands, leaf, print_result, settings_of


def cmd_topics_create(args: argparse.Namespace) -> int:
    from taskq.producer.admin import create_topics

    created = create_topics(settings_of(args), partitions=args.partitions, replication=args.replication)
    lines = [f"{'created' if new else 'exists '}  {name}" for name, new in sorted(created.items())]
    print_result(args, created, "\n".join(lines))
    return 0



def cmd_schemas_register(args: argparse.Namespace) -> int:
    from taskq.schemas import Registry, load_schema

    out = []
    with Registry.from_settings(settings_of(args)) as registry:
        for path in args.paths:
            reg = registry.register(load_schema(path))
            out.append(
                {"subject": reg.subject, "version": reg.version, "id": reg.schema_id, "path": str(path)}
            )
    print_result(
        args,
        out,
        "\n".join(f"{o['subject']}  version {o['version']}  id {o['id']}  ({o['path']})" for o in out),
    )
    return 0


def cmd_schemas_list(args: argparse.Namespace) -> int:
    from taskq.schemas import Registry

    rows = []
    with Registry.from_settings(settings_of(args)) as registry:
        for subject in sorted(registry.subjects()):
            latest = registry.latest(subject)
            rows.append({"subject": subject, "latest_version": latest.version, "id": latest.schema_id})
    print_result(args, rows, "\n".join(f"{r['subject']}  v{r['latest_version']}  id {r['id']}" for r in rows))
    return 0


def cmd_schemas_check(args: argparse.Namespace) -> int:
    from taskq.schemas import Registry, full_name, load_schema

    results = []
    with Registry.from_settings(settings_of(args)) as registry:
        for path in args.paths:
            schema = load_schema(path)
            results.append(
                {"path": str(path), "subject": full_name(schema), "compatible": registry.check(schema)}
            )
    print_result(
        args,
        results,
        "\n".join(
            f"{'compatible  ' if r['compatible'] else 'INCOMPATIBLE'}  {r['subject']}  ({r['path']})"
            for r in results
        ),
    )
    return 0 if all(r["compatible"] for r in results) else 1



def add_topics(sub: Commands) -> None:
    """`taskq topics create`."""
    topics = sub.add_parser("topics", help="provision topics").add_subparsers(dest="sub", required=True)
    sp = leaf(
        topics, "create", cmd_topics_create, "create the priority, delay-tier and DLQ topics (idempotent)"
    )
    sp.add_argument("--partitions", type=int, default=6)
    sp.add_argument(
        "--replication",
        type=int,
        default=None,
        help="copies of each partition (default: the broker's default.replication.factor, with its "
        "min.insync.replicas; given: min.insync.replicas is 2, or 1 below 3 copies)",
    )


def add_schemas(sub: Commands) -> None:
    """`taskq schemas register|list|check`."""
    schemas = sub.add_parser("schemas", help="task type schemas").add_subparsers(dest="sub", required=True)
    sp = leaf(schemas, "register", cmd_schemas_register, "register .avsc files under their record names")
    sp.add_argument("paths", nargs="+", type=Path)
    leaf(schemas, "list", cmd_schemas_list, "list registered task types")
    sp = leaf(
        schemas, "check", cmd_schemas_check, "check .avsc files against the registry (exit 1 if incompatible)"
    )
    sp.add_argument("paths", nargs="+", type=Path)
