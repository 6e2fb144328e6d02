"""Errors of the schemas package; each class docstring is its default message."""

from __future__ import annotations


class SchemaError(Exception):
    """A schema could not be loaded, registered, found or applied."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class SchemaFileError(SchemaError):
    """A schema file is missing, is not JSON, or is not a valid Avro schema."""


class SchemaNotFoundError(SchemaError, LookupError):
    """The registry has no such subject, version or schema id."""


class IncompatibleSchemaError(SchemaError):
    """The registry refused the schema as incompatible with the subject's earlier versions."""


class RegistryUnavailableError(SchemaError):
    """The schema registry could not be reached or answered with a server error."""


class PayloadValidationError(SchemaError, ValueError):
    """The payload does not match the task type's Avro schema."""

    def __init__(self, message: str | None = None, *, task_type: str = "", field: str = "") -> None:
        super().__init__(message)
        self.task_type = task_type
        self.field = field


class DecodeError(SchemaError, ValueError):
    """The bytes are not a Confluent-framed Avro value this reader can decode."""
