"""The schema registry's rules, the same for InMemoryRegistry and the real registry (Confluent API)."""

from __future__ import annotations

from typing import Any

import pytest

from taskq.schemas.errors import IncompatibleSchemaError, SchemaNotFoundError


def record(ns: str, *fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "Order", "namespace": ns, "fields": list(fields)}


ID = {"name": "id", "type": "string"}


def test_versions_evolve_backward_and_ids_are_stable(registry: Any, ns: str) -> None:
    v1 = registry.register(record(ns, ID))
    assert (v1.subject, v1.version) == (f"{ns}.Order", 1)
    assert registry.register(record(ns, ID)).schema_id == v1.schema_id  # the same schema again
    # BACKWARD: a new version must read what the old one wrote: a new field needs a default.
    with_default = record(ns, ID, {"name": "note", "type": "string", "default": ""})
    assert registry.check(with_default)
    v2 = registry.register(with_default)
    assert v2.version == 2 and v2.schema_id != v1.schema_id
    required = record(
        ns, ID, {"name": "note", "type": "string", "default": ""}, {"name": "qty", "type": "int"}
    )
    assert not registry.check(required)
    with pytest.raises(IncompatibleSchemaError):
        registry.register(required)
    retyped = record(ns, {"name": "id", "type": "int"}, {"name": "note", "type": "string", "default": ""})
    with pytest.raises(IncompatibleSchemaError):
        registry.register(retyped)
    promoted = record(ns, ID, {"name": "note", "type": "string", "default": ""})  # unchanged: fine
    assert registry.register(promoted).version == 2
    assert registry.latest(f"{ns}.Order").version == 2
    assert registry.lookup(record(ns, ID)).version == 1
    assert registry.by_id(v1.schema_id) is not None


def test_unknown_subjects_schemas_and_ids_are_not_found(registry: Any, ns: str) -> None:
    with pytest.raises(SchemaNotFoundError):
        registry.latest(f"{ns}.Nothing")
    registry.register(record(ns, ID))
    with pytest.raises(SchemaNotFoundError):
        registry.lookup(record(ns, ID, {"name": "x", "type": "long", "default": 0}))
    with pytest.raises(SchemaNotFoundError):
        registry.by_id(987654321)
