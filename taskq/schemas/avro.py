"""Avro payloads in the Confluent wire format: magic byte 0, 4-byte big-endian schema id, Avro body."""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fastavro
import fastavro.validation
from fastavro.types import Schema as ParsedSchema

from taskq.schemas.errors import DecodeError, PayloadValidationError, SchemaFileError

_HEADER = struct.Struct(">bI")
MAGIC = 0

__all__ = [
    "MAGIC",
    "Check",
    "ParsedSchema",
    "Writer",
    "canonical_json",
    "compile_check",
    "compile_writer",
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
    except (
        json.JSONDecodeError,
        fastavro.schema.SchemaParseException,
        ValueError,
        KeyError,
        TypeError,
    ) as exc:
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
    if isinstance(parsed, dict) and parsed.get("type") == "record" and not isinstance(payload, Mapping):
        raise PayloadValidationError(
            f"invalid payload for {label}: expected an object (mapping), got {type(payload).__name__}",
            task_type=task_type,
        )
    named = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
    problem = _record_problem(parsed, payload, "", named)
    if problem is not None:
        field, text = problem
        raise PayloadValidationError(f"invalid payload for {label}: {text}", task_type=task_type, field=field)
    try:
        fastavro.validation.validate(payload, parsed, raise_errors=True, strict=True)
    except fastavro.validation.ValidationError as exc:
        problems = list(exc.errors) if getattr(exc, "errors", None) else []
        first = problems[0] if problems else None
        field = str(getattr(first, "field", "") or "")
        root = parsed.get("name", "") if isinstance(parsed, dict) else ""
        if root and field.startswith(root + "."):
            field = field[len(root) + 1 :]
        if first is not None and hasattr(first, "datum"):
            # A union reports one problem per branch: the value is expected to be any of them.
            expected = [_type_label(p.schema) for p in problems if getattr(p, "field", None) == first.field]
            alternatives = " or ".join(dict.fromkeys(expected))
            problem_text = f"field {field!r} is {first.datum!r}, expected {alternatives}"
        else:
            problem_text = str(exc).strip()
        raise PayloadValidationError(
            f"invalid payload for {label}: {problem_text}", task_type=task_type, field=field
        ) from None


#: Ranges of Avro's int and long; fastavro's validation holds values to them.
_INT = (-(2**31), 2**31 - 1)
_LONG = (-(2**63), 2**63 - 1)

Check = Callable[[Any], bool]


def compile_check(parsed: ParsedSchema) -> Check | None:
    """A quick test of payloads against a parsed schema, for the producer's hot path, or None.

    The test is conservative: True means `validate` would accept the payload (every field of every record
    given, each value of exactly the Python type Avro writes, within range), so the full validation can be
    skipped. False means "not known to be valid": run `validate`, which accepts or names the problem.
    Schemas with logical types or recursive records get no quick test (None): `validate` decides alone.
    """
    named = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
    try:
        return _check_of(parsed, named, frozenset())
    except _NoQuickCheck:
        return None


class _NoQuickCheck(Exception):
    """A schema construct the quick test does not cover."""


def _ranged(low: int, high: int) -> Check:
    return lambda v: type(v) is int and low <= v <= high


def _check_of(schema: Any, named: Mapping[str, Any], seen: frozenset[str]) -> Check:
    if isinstance(schema, str):
        simple: dict[str, Check] = {
            "null": lambda v: v is None,
            "boolean": lambda v: type(v) is bool,
            "int": _ranged(*_INT),
            "long": _ranged(*_LONG),
            # fastavro writes any int as a double; one beyond a double's range would not convert.
            "float": lambda v: type(v) is float or (type(v) is int and -(2**53) <= v <= 2**53),
            "double": lambda v: type(v) is float or (type(v) is int and -(2**53) <= v <= 2**53),
            "string": lambda v: type(v) is str,
            "bytes": lambda v: type(v) is bytes,
        }
        if schema in simple:
            return simple[schema]
        if schema in named and schema not in seen:
            return _check_of(named[schema], named, seen | {schema})
        raise _NoQuickCheck(schema)
    if isinstance(schema, list):
        branches = tuple(_check_of(b, named, seen) for b in schema)
        return lambda v: any(check(v) for check in branches)
    if not isinstance(schema, dict) or "logicalType" in schema:
        raise _NoQuickCheck(str(schema))
    kind = schema.get("type")
    if kind == "record":
        name = str(schema.get("name", ""))
        inner = seen | {name}
        fields = tuple((f["name"], _check_of(f["type"], named, inner)) for f in schema["fields"])
        names = frozenset(n for n, _ in fields)

        def record(v: Any) -> bool:
            # A loop, not all() over a generator: this runs once per enqueue, and the loop is twice as fast.
            if type(v) is not dict or v.keys() != names:
                return False
            for n, check in fields:
                if not check(v[n]):
                    return False
            return True

        return record
    if kind == "enum":
        symbols = frozenset(schema["symbols"])
        return lambda v: type(v) is str and v in symbols
    if kind == "fixed":
        size = schema["size"]
        return lambda v: type(v) is bytes and len(v) == size
    if kind == "array":
        items = _check_of(schema["items"], named, seen)
        return lambda v: type(v) is list and all(items(x) for x in v)
    if kind == "map":
        values = _check_of(schema["values"], named, seen)
        return lambda v: type(v) is dict and all(type(k) is str and values(x) for k, x in v.items())
    if isinstance(kind, str | list | dict):
        return _check_of(kind, named, seen)
    raise _NoQuickCheck(str(kind))


def _record_problem(schema: Any, value: Any, path: str, named: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field path, problem) for the first unknown or missing field of a record, at any depth; else None."""
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if isinstance(schema, list):  # a union: look into the one record branch a mapping can be
        branches = [named.get(b, b) if isinstance(b, str) else b for b in schema]
        records = [s for s in branches if isinstance(s, dict) and s.get("type") == "record"]
        return _record_problem(records[0], value, path, named) if len(records) == 1 else None
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind == "array" and isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _record_problem(schema["items"], item, f"{path}[{i}]", named)) is not None:
                return found
    elif kind == "map" and isinstance(value, Mapping):
        for k, item in value.items():
            if (found := _record_problem(schema["values"], item, f"{path}[{k!r}]", named)) is not None:
                return found
    elif kind == "record" and isinstance(value, Mapping):
        fields = {f["name"]: f for f in schema["fields"]}
        # Unknown keys would be dropped silently by the Avro writer: losing data the caller meant to send.
        for name in value:
            if name not in fields:
                where = f"{path}.{name}" if path else str(name)
                return where, f"field {where!r} is not in the schema (fields: {', '.join(fields)})"
        for name, f in fields.items():
            where = f"{path}.{name}" if path else name
            if name not in value:
                if "default" not in f:
                    return where, f"required field {where!r} is missing"
            elif (found := _record_problem(f["type"], value[name], where, named)) is not None:
                return found
    return None


def _type_label(schema: Any) -> str:
    if isinstance(schema, list):
        return " or ".join(_type_label(s) for s in schema)
    if isinstance(schema, dict):
        return str(schema.get("logicalType") or schema.get("name") or schema.get("type"))
    return str(schema)


Writer = Callable[[Any], bytes]


def compile_writer(parsed: ParsedSchema) -> Writer | None:
    """An Avro encoder of payloads that passed `compile_check`'s test, for the producer's hot path, or None.

    It writes the same bytes as `encode` for every payload that test accepts (exact Python types, every field
    given), without fastavro's per-call set-up. Schemas the test does not cover, and unions other than
    `["null", T]`, get none: `encode` writes them.
    """
    named = parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}
    try:
        _check_of(parsed, named, frozenset())
        return _writer_of(parsed, named, frozenset())
    except _NoQuickCheck:
        return None


#: The one-byte varints, 0 to 127.
_SMALL = tuple(bytes((i,)) for i in range(128))
_FLOAT = struct.Struct("<f").pack
_DOUBLE = struct.Struct("<d").pack


def _long(n: int) -> bytes:
    """A zig-zag varint (Avro int and long)."""
    z = (n << 1) ^ (n >> 63)
    if z < 0x80:
        return _SMALL[z]
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _string(v: str) -> bytes:
    b = v.encode()
    return _long(len(b)) + b


def _bytes(v: bytes) -> bytes:
    return _long(len(v)) + v


def _writer_of(schema: Any, named: Mapping[str, Any], seen: frozenset[str]) -> Writer:
    if isinstance(schema, str):
        simple: dict[str, Writer] = {
            "null": lambda v: b"",
            "boolean": lambda v: b"\x01" if v else b"\x00",
            "int": _long,
            "long": _long,
            "float": _FLOAT,
            "double": _DOUBLE,
            "string": _string,
            "bytes": _bytes,
        }
        if schema in simple:
            return simple[schema]
        if schema in named and schema not in seen:
            return _writer_of(named[schema], named, seen | {schema})
        raise _NoQuickCheck(schema)
    if isinstance(schema, list):
        if len(schema) == 2 and schema[0] == "null" and schema[1] != "null":
            other = _writer_of(schema[1], named, seen)
            return lambda v: b"\x00" if v is None else b"\x02" + other(v)
        raise _NoQuickCheck(str(schema))
    if not isinstance(schema, dict) or "logicalType" in schema:
        raise _NoQuickCheck(str(schema))
    kind = schema.get("type")
    if kind == "record":
        inner = seen | {str(schema.get("name", ""))}
        fields = tuple((f["name"], _writer_of(f["type"], named, inner)) for f in schema["fields"])
        if len(fields) == 1:
            ((name, write),) = fields
            return lambda v: write(v[name])
        return lambda v: b"".join([write(v[n]) for n, write in fields])
    if kind == "enum":
        index = {symbol: _long(i) for i, symbol in enumerate(schema["symbols"])}
        return index.__getitem__
    if kind == "fixed":
        return bytes
    if kind == "array":
        items = _writer_of(schema["items"], named, seen)
        return lambda v: _long(len(v)) + b"".join([items(x) for x in v]) + b"\x00" if v else b"\x00"
    if kind == "map":
        values = _writer_of(schema["values"], named, seen)
        return lambda v: (
            _long(len(v)) + b"".join([_string(k) + values(x) for k, x in v.items()]) + b"\x00"
            if v
            else b"\x00"
        )
    if isinstance(kind, str | list | dict):
        return _writer_of(kind, named, seen)
    raise _NoQuickCheck(str(kind))


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
