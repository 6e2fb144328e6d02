"""Registering never weakens a subject's compatibility level, and checks honour transitive levels."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from taskq._core.settings import Settings
from taskq.schemas import IncompatibleSchemaError, Registry
from taskq.schemas.rest import RestClient


def order(ns: str, *fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "Order", "namespace": ns, "fields": [{"name": "id", "type": "string"}, *fields]}


def test_an_operators_transitive_level_is_kept_and_enforced_against_every_version(settings: Settings) -> None:
    ns = settings.namespace
    subject = f"{ns}.Order"
    v1 = order(ns, {"name": "a", "type": "string"})
    v2 = order(ns)  # drops a: reads v1's data
    v3 = order(ns, {"name": "a", "type": "int", "default": 0})  # reads v2's data, not v1's (a is a string there)
    operator = RestClient(settings.schema_registry_url, {})  # the registry's REST API, as an operator uses it
    with Registry(settings.schema_registry_url) as registry:
        registry.register(v1)
        registry.register(v2)
        operator.put(f"config/{subject}", {"compatibility": "BACKWARD_TRANSITIVE"})
        assert registry.check(v3) is False
        with pytest.raises(IncompatibleSchemaError):
            registry.register(v3)
        assert operator.get(f"config/{subject}")["compatibilityLevel"] == "BACKWARD_TRANSITIVE"
        assert registry.versions(subject) == [1, 2]




def _register_at_once(url: str, schema: dict[str, Any], processes: int) -> list[BaseException]:
    """Registers the schema from that many clients released together; what they raised."""
    start = threading.Barrier(processes)
    failures: list[BaseException] = []

    def register() -> None:
        with Registry(url) as registry:
            start.wait()
            try:
                registry.register(schema)
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=register) for _ in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_processes_registering_a_new_subject_at_once_all_succeed(settings: Settings) -> None:
    # Each reads "no level of its own" and sets one; the registry refuses all but the first of those
    # settings ("a rule named 'COMPATIBILITY' already exists"). Workers of one deploy start together.
    operator = RestClient(settings.schema_registry_url, {})
    for n in range(5):
        schema = {"type": "record", "name": f"Order{n}", "namespace": settings.namespace, "fields": []}
        assert _register_at_once(settings.schema_registry_url, schema, 4) == []
        assert operator.get(f"config/{settings.namespace}.Order{n}")["compatibilityLevel"] == "BACKWARD"
