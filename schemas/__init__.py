"""Avro schemas of task types, the Confluent wire format, and the schema registry client."""

from schemas.avro import decode, encode, frame, full_name, load_schema, parse, split_frame, validate
from schemas.errors import (
    DecodeError,
    IncompatibleSchemaError,
    PayloadValidationError,
    RegistryUnavailableError,
    SchemaError,
    SchemaFileError,
    SchemaNotFoundError,
)
from schemas.registry import RegisteredSchema, Registry

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
