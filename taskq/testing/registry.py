"""`InMemoryRegistry`: a schema registry in memory, with BACKWARD compatibility."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from itertools import count
from typing import Any

from taskq.schemas import avro
from taskq.schemas.errors import IncompatibleSchemaError, SchemaNotFoundError
from taskq.schemas.registry import RegisteredSchema

_PROMOTIONS = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "string": {"string", "bytes"},
    "bytes": {"bytes", "string"},
}


def _type_name(t: Any) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        return "union"
    return str(t.get("type")) if isinstance(t, Mapping) else repr(t)


def _reads(reader: Any, writer: Any, path: str) -> str | None:
    """Why data written with `writer` cannot be read with `reader` (Avro resolution), or None."""
    if isinstance(writer, list):  # every branch the writer may have used must be readable
        for w in writer:
            problem = _reads(reader, w, path)
            if problem:
                return problem
        return None
    if isinstance(reader, list):
        return (
            None if any(_reads(r, writer, path) is None for r in reader) else f"{path}: no union branch fits"
        )
    r, w = _type_name(reader), _type_name(writer)
    if r == "record" and w == "record":
        old = {f["name"]: f for f in writer.get("fields", [])}
        for f in reader.get("fields", []):
            if f["name"] in old:
                problem = _reads(f["type"], old[f["name"]]["type"], f"{path}.{f['name']}")
                if problem:
                    return problem
            elif "default" not in f:
                return f"{path}.{f['name']}: new field without a default"
        return None
    if r in ("array", "map") and r == w:
        key = "items" if r == "array" else "values"
        return _reads(reader[key], writer[key], f"{path}[]")
    if r == "enum" and w == "enum":
        missing = set(writer.get("symbols", [])) - set(reader.get("symbols", []))
        return (
            f"{path}: enum symbols {sorted(missing)} removed" if missing and "default" not in reader else None
        )
    if r == "fixed" and w == "fixed":
        return None if reader.get("size") == writer.get("size") else f"{path}: fixed size changed"
    if r == w or r in _PROMOTIONS.get(w, set()):
        return None
    return f"{path}: {w} cannot be read as {r}"


class InMemoryRegistry:
    """A schema registry in memory: subjects named by the record's full name, versions under BACKWARD
    compatibility (a new version must read data written with the latest one), ids that never change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subjects: dict[str, list[RegisteredSchema]] = {}
        self._by_id: dict[int, RegisteredSchema] = {}
        self._ids = count(1)

    def register(
        self, schema: Mapping[str, Any], *, compatibility: str | None = "BACKWARD"
    ) -> RegisteredSchema:
        """Register a record schema under its full name; IncompatibleSchemaError if it breaks BACKWARD."""
        subject = avro.full_name(schema)
        parsed = avro.parse(schema, source=f"schema of {subject}")
        text = avro.canonical_json(schema)
        with self._lock:
            versions = self._subjects.setdefault(subject, [])
            for reg in versions:
                if avro.canonical_json(reg.schema) == text:
                    return reg
            if versions and compatibility:
                problem = _reads(dict(schema), versions[-1].schema, subject)
                if problem:
                    raise IncompatibleSchemaError(
                        f"registering {subject}: incompatible with version {versions[-1].version}: {problem}"
                    )
            same = next((r for r in self._by_id.values() if avro.canonical_json(r.schema) == text), None)
            schema_id = same.schema_id if same else next(self._ids)
            reg = RegisteredSchema(subject, schema_id, len(versions) + 1, dict(schema), parsed)
            versions.append(reg)
            self._by_id.setdefault(schema_id, reg)
            return reg

    def check(self, schema: Mapping[str, Any]) -> bool:
        """Whether the schema may become the next version of its subject (True for a new subject)."""
        with self._lock:
            versions = self._subjects.get(avro.full_name(schema))
            return not versions or _reads(dict(schema), versions[-1].schema, "") is None

    def latest(self, subject: str) -> RegisteredSchema:
        """The latest version of a subject; SchemaNotFoundError if unregistered."""
        with self._lock:
            versions = self._subjects.get(subject)
            if not versions:
                raise SchemaNotFoundError(f"looking up task type {subject}: Subject '{subject}' not found")
            return versions[-1]

    def lookup(self, schema: Mapping[str, Any]) -> RegisteredSchema:
        """The registered version identical to this schema; SchemaNotFoundError if never registered."""
        subject, text = avro.full_name(schema), avro.canonical_json(schema)
        with self._lock:
            for reg in self._subjects.get(subject, []):
                if avro.canonical_json(reg.schema) == text:
                    return reg
        raise SchemaNotFoundError(f"looking up {subject}: schema not found")

    def cached(self, schema_id: int) -> avro.ParsedSchema | None:
        """The parsed schema of an id."""
        with self._lock:
            reg = self._by_id.get(schema_id)
            return reg.parsed if reg else None

    def by_id(self, schema_id: int) -> avro.ParsedSchema:
        """The parsed writer schema of an id; SchemaNotFoundError if none."""
        parsed = self.cached(schema_id)
        if parsed is None:
            raise SchemaNotFoundError(f"fetching schema id {schema_id}: Schema {schema_id} not found")
        return parsed

    def subjects(self) -> list[str]:
        """Every subject."""
        with self._lock:
            return sorted(s for s, v in self._subjects.items() if v)

    def versions(self, subject: str) -> list[int]:
        """The version numbers of a subject."""
        with self._lock:
            return [r.version for r in self._subjects.get(subject, [])]

    def delete_subject(self, subject: str) -> None:
        """Forget a subject's versions (ids stay readable, as in a registry)."""
        with self._lock:
            self._subjects.pop(subject, None)

    def close(self) -> None:
        """Nothing to release."""

