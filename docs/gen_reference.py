"""The generated parts of the reference: read from the code at build time, so they cannot drift from it.

An mkdocs hook (mkdocs.yml `hooks:`): a page holding `<!-- gen:NAME -->` gets the Markdown that the
generator NAME returns in its place. Every generator is a plain function returning Markdown, which
tests/unit/test_docs_reference.py checks without building the site.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "taskq"
MIGRATIONS = PACKAGE / "_core" / "sql" / "migrations"
MARKER = re.compile(r"<!-- gen:([a-z-]+) -->")

# --- the Python API -------------------------------------------------------------------------------------

#: Sections of the API page. A public name in no section lands in "Other", so none is ever left out.
API_SECTIONS = {
    "Enqueueing": [
        "TaskProducer",
        "AsyncTaskProducer",
        "TaskSpec",
        "Receipt",
        "RateLimit",
        "derive_idempotency_key",
    ],
    "Status, results and cancellation": ["TaskStatus", "TaskState"],
    "Workflows": ["chain", "group", "WorkflowReceipt", "WorkflowStatus"],
    "Handling and running": [
        "Handlers",
        "TaskContext",
        "Retry",
        "Reject",
        "RetryPolicy",
        "Worker",
        "WorkerConfig",
        "DeadLetters",
    ],
    "Configuration and vocabulary": ["Settings", "PRIORITIES", "Priority", "__version__"],
    "Errors": [
        "TaskqError",
        "DeliveryError",
        "InvalidPriorityError",
        "InvalidTaskError",
        "KafkaUnavailableError",
        "PayloadTooLargeError",
        "ProducerClosedError",
        "QueueFullError",
        "RateLimitedError",
        "StoreUnavailableError",
        "UnknownTaskTypeError",
        "TaskFailed",
        "TaskCancelled",
        "NotCancellableError",
        "ResultError",
        "SchemaError",
        "PayloadValidationError",
    ],
}


def python_api() -> str:
    """One mkdocstrings block per name of `taskq.__all__`, in sections."""
    import taskq

    public = list(taskq.__all__)
    placed = {name for names in API_SECTIONS.values() for name in names}
    sections = {k: [n for n in v if n in public] for k, v in API_SECTIONS.items()}
    sections["Other"] = [n for n in public if n not in placed]
    out = []
    for title, names in sections.items():
        if not names:
            continue
        out.append(f"## {title}\n")
        for name in names:
            if name == "__version__":  # a plain string: mkdocstrings has nothing to render for it
                out.append(f"### `taskq.__version__`\n\nThe release, `{taskq.__version__}`.\n")
                continue
            out.append(f"::: taskq.{name}\n")
    return "\n".join(out)


# --- the CLI ----------------------------------------------------------------------------------------------


def cli_commands(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every leaf command of the `taskq` parser, as (`taskq dlq replay`, its parser), in parser order."""
    if parser is None:
        from taskq.cli import build_parser

        parser = build_parser()

    def walk(p: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield path, p
        for action in subs:
            for name, child in action.choices.items():
                yield from walk(child, f"{path} {name}")

    return list(walk(parser, "taskq"))


def _options_table(p: argparse.ArgumentParser) -> str:
    rows = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = (
            ", ".join(f"`{s}`" for s in a.option_strings) if a.option_strings else f"`{a.metavar or a.dest}`"
        )
        default = ""
        if a.default not in (None, False, argparse.SUPPRESS) and not a.required:
            default = f"`{a.default}`"
        what = (a.help or "").replace("|", "\\|").replace("\n", " ")
        if a.choices:
            what += (" " if what else "") + "(" + ", ".join(f"`{c}`" for c in a.choices) + ")"
        if a.required and a.option_strings:
            what += " **required**"
        rows.append(f"| {name} | {default} | {what} |")
    if not rows:
        return ""
    return "| argument | default | what |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def cli() -> str:
    """A section per leaf command: its description, usage and arguments, read from `build_parser()`."""
    from taskq.cli import build_parser

    parser = build_parser()
    out = [
        "## Global options\n",
        "Given before the command (`taskq --namespace demo stats`).\n",
        "```\n" + parser.format_usage().strip() + "\n```\n",
        _options_table(parser),
    ]
    for path, p in cli_commands(parser):
        out.append(f"## `{path}`\n")
        if p.description:
            out.append(p.description.strip().rstrip(".") + ".\n")
        usage = p.format_usage().strip().removeprefix("usage: ")
        out.append("```\n" + usage + "\n```\n")
        table = _options_table(p)
        if table:
            out.append(table)
    return "\n".join(out)


# --- settings and environment variables --------------------------------------------------------------------

#: Variables read by the `taskq` command itself rather than by `Settings`: name -> (default, what).
COMMAND_VARIABLES = {
    "TASKQ_LOG_FORMAT": (
        "text",
        "Log lines as `text` or one JSON object each (`json`); `--log-format` wins.",
    ),
    "TASKQ_CONSOLE_TOKEN": (
        "",
        "The console's access token; required when `taskq console` listens on any address but loopback.",
    ),
}


def _shown_default(value: Any) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], timedelta):
        from taskq._core.durations import tier_name

        return "`" + ",".join(tier_name(t) for t in value) + "`"
    if isinstance(value, tuple):
        return "`" + ",".join(value) + "`"
    if value == "":
        return "(empty)"
    return f"`{value}`"


def settings() -> str:
    """Every `Settings` field with its variable, default and description, then the command's variables."""
    from taskq._core.settings import Settings

    rows = []
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        env = f.metadata.get("env", "")
        if f.name == "kafka":
            default = "(none)"
        elif f.name == "worker_group":  # filled in from the namespace when created
            default = "`<namespace>.workers`"
        else:
            default = _shown_default(getattr(defaults, f.name))
        rows.append(
            f"| `{f.name}` | {f'`{env}`' if env else '(code only)'} | {default} | {f.metadata['doc']} |"
        )
    commands = [f"| `{var}` | {_shown_default(d)} | {what} |" for var, (d, what) in COMMAND_VARIABLES.items()]
    return (
        "## `Settings` fields and their variables\n\n"
        "| field | variable | default | what |\n|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "## Read by the `taskq` command\n\n"
        "| variable | default | what |\n|---|---|---|\n" + "\n".join(commands) + "\n"
    )


def variables_in_code() -> set[str]:
    """Every complete `TASKQ_*` variable name written in the package's source (prefixes excluded)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if "tools" in path.relative_to(PACKAGE).parts:  # the chaos tool's own variables drive its runs
            continue
        found.update(re.findall(r"\bTASKQ_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


# --- metrics ------------------------------------------------------------------------------------------------

_KINDS = ("Counter", "Gauge", "Histogram", "Summary")


@dataclasses.dataclass(frozen=True)
class Metric:
    """One Prometheus metric as its code defines it."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    module: str
    multiprocess_mode: str = ""


def metrics() -> list[Metric]:
    """Every metric the package defines: each `Counter`/`Gauge`/`Histogram` call with a literal name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _KINDS
            ):
                continue
            if not (node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value)):
                continue
            name = node.args[0].value
            if not (isinstance(name, str) and name.startswith("taskq_")):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            labels_node = node.args[2] if len(node.args) > 2 else kw.get("labelnames")
            labels = tuple(ast.literal_eval(labels_node)) if labels_node is not None else ()
            help_node = node.args[1] if len(node.args) > 1 else kw.get("documentation")
            mode = kw.get("multiprocess_mode")
            found.append(
                Metric(
                    name=name,
                    kind=node.func.id.lower(),
                    help=ast.literal_eval(help_node) if help_node is not None else "",
                    labels=labels,
                    module=module,
                    multiprocess_mode=ast.literal_eval(mode) if mode is not None else "",
                )
            )
    return sorted(found, key=lambda m: m.name)


#: Who exports the metrics of a module.
_EXPORTED_BY = {
    "taskq.consumer.metrics": "each worker (`--metrics-port`)",
    "taskq.producer.metrics": "any process with a producer (default registry)",
    "taskq.producer.outbox": "any process with an outbox relay (workers, `taskq relay`)",
    "taskq.consumer.dlq": "`taskq stats --metrics-port`",
}


def metrics_table() -> str:
    """The metrics as a table: name, type, labels, meaning, who exports it."""
    rows = []
    for m in metrics():
        labels = ", ".join(f"`{label}`" for label in m.labels) or "none"
        if m.multiprocess_mode == "liveall":  # one series per process under `--processes N`
            labels += " (and `pid` under `--processes N`)"
        by = _EXPORTED_BY.get(m.module) or (
            "`taskq stats --metrics-port`" if m.module.startswith("taskq.cli") else f"`{m.module}`"
        )
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {m.help} | {by} |")
    return "| metric | type | labels | what | exported by |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"


# --- the wire format ----------------------------------------------------------------------------------------

#: What each envelope header holds. A header constant of the code without an entry here fails the build.
HEADER_MEANINGS = {
    "taskq-task-id": "32 hex digits, new for each enqueue (the idempotency key, not this, decides effects)",
    "taskq-task-type": "the full name of the task's Avro record, e.g. `demo.SendEmail`",
    "taskq-idempotency-key": "one effect per key (`charge:<payment-id>`); from the payload if not given",
    "taskq-priority": "`critical`, `high`, `normal` or `low`",
    "taskq-attempt": "the attempt this record is for, from 1",
    "taskq-max-attempts": "attempts allowed, 1 to 1000 (absent: the handler's)",
    "taskq-enqueued-at": "milliseconds since 1970 (UTC) when it was first enqueued",
    "taskq-not-before": "on delay topics: milliseconds since 1970 before which it must not run",
    "taskq-timeout": "seconds an attempt may run (absent: the handler's)",
    "taskq-origin-topic": "on delay topics and the DLQ: the priority topic it belongs to",
    "taskq-dlq-reason": "DLQ only: why it was dead-lettered, one line",
    "taskq-dlq-error-type": "DLQ only: the error's qualified type, e.g. `taskq.PoisonPill`",
    "taskq-dlq-traceback": "DLQ only: the handler's traceback, bounded",
    "taskq-dlq-attempts": "DLQ only: attempts made",
    "taskq-dlq-failed-at": "DLQ only: milliseconds since 1970 when it was dead-lettered",
    "taskq-dlq-worker": "DLQ only: the worker id that dead-lettered it",
    "taskq-dlq-topic": "DLQ only: the topic the failed record was read from",
    "taskq-dlq-partition": "DLQ only: its partition",
    "taskq-dlq-offset": "DLQ only: its offset",
    "taskq-dlq-value-bytes": "DLQ only, for a record too large to republish: the size of the original value",
    "taskq-dlq-value-sha256": "DLQ only, for a record too large to republish: the SHA-256 of the value",
    "taskq-workflow": "a workflow's step only: `<workflow id>:<node>`, kept across its attempts",
    "traceparent": "W3C trace context of the enqueue (OpenTelemetry), when tracing is on",
}


def header_names() -> list[str]:
    """The header names the code defines: the envelope's and the DLQ's constants, and `traceparent`."""
    from taskq._core import envelope
    from taskq.consumer import routing

    names = [
        value
        for module in (envelope, routing)
        for key, value in vars(module).items()
        if key.isupper() and isinstance(value, str) and value.startswith(envelope.H) and value != envelope.H
    ]
    return [*dict.fromkeys(names), "traceparent"]


def headers() -> str:
    """The header table; a header the code defines without a meaning here is an error."""
    rows = []
    for name in header_names():
        if name not in HEADER_MEANINGS:
            raise KeyError(f"header {name} has no entry in docs/gen_reference.py HEADER_MEANINGS")
        rows.append(f"| `{name}` | {HEADER_MEANINGS[name]} |")
    return "| header | holds |\n|---|---|\n" + "\n".join(rows) + "\n"


def topics() -> str:
    """The topics of a namespace `<ns>` with the default delay tiers."""
    from taskq._core.durations import DEFAULT_DELAY_TIERS
    from taskq._core.envelope import Topics

    t = Topics("<ns>", DEFAULT_DELAY_TIERS)
    rows = [f"| `{name}` | priority tier: tasks to run |" for name in t.priority_topics]
    rows += [f"| `{name}` | delay tier: delayed tasks and retries wait here |" for name in t.delay_topics]
    rows.append(f"| `{t.dlq}` | dead-letter topic |")
    return "| topic | carries |\n|---|---|\n" + "\n".join(rows) + "\n"


# --- the Postgres schema ------------------------------------------------------------------------------------


def postgres_schema() -> str:
    """Every migration, in the order they run, with its SQL."""
    out = []
    for path in sorted(MIGRATIONS.glob("*.sql")):
        out.append(f"### `{path.name}`\n\n```sql\n{path.read_text().strip()}\n```\n")
    return "\n".join(out)


def tables() -> list[str]:
    """The tables the migrations create."""
    sql = "\n".join(p.read_text() for p in sorted(MIGRATIONS.glob("*.sql")))
    return sorted(set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", sql)))


# --- the hook -----------------------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[], str]] = {
    "python-api": python_api,
    "cli": cli,
    "settings": settings,
    "metrics": metrics_table,
    "headers": headers,
    "topics": topics,
    "postgres-schema": postgres_schema,
}


def expand(markdown: str) -> str:
    """`markdown` with each `<!-- gen:NAME -->` replaced by what generator NAME returns."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"unknown generator {name!r}: one of {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: expand the generated parts of a page."""
    return expand(markdown)
