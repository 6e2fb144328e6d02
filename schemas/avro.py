"""Avro payloads in the Confluent wire format: magic byte 0, 4-byte big-endian schema id, Avro body."""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fastavro
import fastavro.validation
from fastavro.types import Schema as ParsedSchema

from schemas.errors import DecodeError, PayloadValidationError, SchemaFileError

_HEADER = struct.Struct(">bI")
MAGIC = 0

__all__ = [
    "MAGIC",
    "ParsedSchema",
    "canonical_json",
    "decode",
    "encode",
    "frame",
    "full_name",
    "load_schema",
    "parse",
    "split_frame",
    "validate",
]


def load_schema(path: str | Path) -> dict[str, Any]:
    """Read an .avsc file; SchemaFileError names the file and the problem."""
    p = Path(path)
    try:
        schema = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SchemaFileError(f"cannot read schema file {p}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise SchemaFileError(f"schema file {p} is not JSON: {exc}") from exc
    parse(schema, source=str(p))
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise SchemaFileError(f"schema file {p} must hold an Avro record (a task type is a record)")
    return schema


def parse(schema: Mapping[str, Any] | str, *, source: str = "schema") -> ParsedSchema:
    """Parse an Avro schema (a dict or its JSON text) with fastavro."""
    try:
        raw = json.loads(schema) if isinstance(schema, str) else dict(schema)
        return fastavro.parse_schema(raw)
    except (json.JSONDecodeError, fastavro.schema.SchemaParseException, ValueError, KeyError, TypeError) as exc:
        raise SchemaFileError(f"{source} is not a valid Avro schema: {exc}") from exc


def full_name(schema: Mapping[str, Any] | str) -> str:
    """The full name (namespace.name) of a record schema: a task type and its registry subject."""
    s = json.loads(schema) if isinstance(schema, str) else schema
    name = str(s.get("name", ""))
    ns = s.get("namespace")
    return name if "." in name or not ns else f"{ns}.{name}"


def canonical_json(schema: Mapping[str, Any] | str) -> str:
    """The schema as compact JSON text, as sent to the registry."""
    s = json.loads(schema) if isinstance(schema, str) else schema
    return json.dumps(s, separators=(",", ":"), sort_keys=False)


def validate(parsed: ParsedSchema, payload: Any, *, task_type: str = "") -> None:
    """Check a payload against a parsed schema; PayloadValidationError names the field and the problem."""
    label = task_type or "task"
    if isinstance(parsed, dict) and parsed.get("type") == "record":
        if not isinstance(payload, Mapping):
            raise PayloadValidationError(
                f"invalid payload for {label}: expected an object (mapping), got {type(payload).__name__}",
                task_type=task_type,
            )
        fields = {f["name"]: f for f in parsed["fields"]}
        # Unknown keys would be dropped silently by the Avro writer: losing data the caller meant to send.
        for name in payload:
            if name not in fields:
                raise PayloadValidationError(
                    f"invalid payload for {label}: field {name!r} is not in the schema "
                    f"(fields: {', '.join(fields)})",
                    task_type=task_type,
                    field=str(name),
                )
        for name, f in fields.items():
            if name not in payload and "default" not in f:
                raise PayloadValidationError(
                    f"invalid payload for {label}: required field {name!r} is missing",
                    task_type=task_type,
                    field=name,
                )
    try:
        fastavro.validation.validate(payload, parsed, raise_errors=True, strict=True)
    except fastavro.validation.ValidationError as exc:
        problems = list(exc.errors) if getattr(exc, "errors", None) else []
        first = problems[0] if problems else None
        field = str(getattr(first, "field", "") or "")
        if task_type and field.startswith(task_type + "."):
            field = field[len(task_type) + 1 :]
        if first is not None and hasattr(first, "datum"):
            problem = f"field {field!r} is {first.datum!r}, expected {_type_label(first.schema)}"
        else:
            problem = str(exc).strip()
        raise PayloadValidationError(
            f"invalid payload for {label}: {problem}", task_type=task_type, field=field
        ) from None


def _type_label(schema: Any) -> str:
    if isinstance(schema, list):
        return " or ".join(_type_label(s) for s in schema)
    if isinstance(schema, dict):
        return str(schema.get("logicalType") or schema.get("name") or schema.get("type"))
    return str(schema)


def encode(parsed: ParsedSchema, payload: Any) -> bytes:
    """The Avro binary body of a payload (no framing); the payload must be valid."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, payload)
    return buf.getvalue()


def frame(schema_id: int, body: bytes) -> bytes:
    """Prefix an Avro body with the Confluent magic byte and schema id."""
    return _HEADER.pack(MAGIC, schema_id) + body


def split_frame(value: bytes | None) -> tuple[int, bytes]:
    """The schema id and Avro body of a Confluent-framed value; DecodeError for anything else."""
    if value is None:
        raise DecodeError("the record has no value (a tombstone), not a Confluent-framed Avro payload")
    if len(value) < _HEADER.size:
        raise DecodeError(f"value of {len(value)} bytes is too short for the Confluent wire format")
    magic, schema_id = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise DecodeError(f"value starts with byte {magic & 0xFF:#04x}, not the Confluent magic byte 0x00")
    return schema_id, value[_HEADER.size :]


def decode(body: bytes, writer: ParsedSchema, reader: ParsedSchema | None = None) -> Any:
    """Decode an Avro body written with `writer` into `reader` (Avro schema resolution)."""
    buf = io.BytesIO(body)
    try:
        datum = fastavro.schemaless_reader(buf, writer, reader)
    except fastavro.read.SchemaResolutionError as exc:
        raise DecodeError(f"payload cannot be resolved into the reader schema: {exc}") from exc
    except (EOFError, ValueError, IndexError, UnicodeDecodeError, struct.error, OverflowError) as exc:
        raise DecodeError(f"Avro body does not match its writer schema: {type(exc).__name__}: {exc}") from exc
    if buf.tell() != len(body):
        raise DecodeError(f"Avro body has {len(body) - buf.tell()} trailing bytes after the record")
    return datum
