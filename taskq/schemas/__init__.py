"""Avro schemas of task types, the Confluent wire format, and the schema registry client.

Names are imported on first use: `taskq.schemas.avro` alone (what a handler's child process needs) does not
load the registry client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from taskq._core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ("decode", "encode", "frame", "full_name", "load_schema", "parse", "split_frame", "validate"),
        "taskq.schemas.avro",
    ),
    **dict.fromkeys(
        (
            "DecodeError",
            "IncompatibleSchemaError",
            "PayloadValidationError",
            "RegistryUnavailableError",
            "SchemaError",
            "SchemaFileError",
            "SchemaNotFoundError",
        ),
        "taskq.schemas.errors",
    ),
    "RegisteredSchema": "taskq.schemas.registry",
    "Registry": "taskq.schemas.registry",
}

__all__ = [
    "DecodeError",
    "IncompatibleSchemaError",
    "PayloadValidationError",
    "RegisteredSchema",
    "Registry",
    "RegistryUnavailableError",
    "SchemaError",
    "SchemaFileError",
    "SchemaNotFoundError",
    "decode",
    "encode",
    "frame",
    "full_name",
    "load_schema",
    "parse",
    "split_frame",
    "validate",
]

if TYPE_CHECKING:
    from taskq.schemas.avro import decode, encode, frame, full_name, load_schema, parse, split_frame, validate
    from taskq.schemas.errors import (
        DecodeError,
        IncompatibleSchemaError,
        PayloadValidationError,
        RegistryUnavailableError,
        SchemaError,
        SchemaFileError,
        SchemaNotFoundError,
    )
    from taskq.schemas.registry import RegisteredSchema, Registry

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
