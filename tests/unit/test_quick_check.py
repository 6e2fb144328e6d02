"""The producer's quick payload test never accepts what full validation refuses; it covers usual payloads."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from taskq.schemas import avro
from taskq.schemas.errors import PayloadValidationError

SCHEMA = avro.parse(
    {
        "type": "record",
        "name": "Order",
        "namespace": "shop",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "qty", "type": "int"},
            {"name": "price", "type": "double"},
            {"name": "note", "type": ["null", "string"], "default": None},
            {"name": "paid", "type": "boolean"},
            {"name": "blob", "type": "bytes"},
            {"name": "state", "type": {"type": "enum", "name": "State", "symbols": ["NEW", "PAID"]}},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "attrs", "type": {"type": "map", "values": "long"}},
            {"name": "sig", "type": {"type": "fixed", "name": "Sig", "size": 2}},
            {
                "name": "to",
                "type": {"type": "record", "name": "Addr", "fields": [{"name": "city", "type": "string"}]},
            },
            {"name": "from_", "type": "Addr"},
        ],
    }
)

VALID: dict[str, Any] = {
    "id": 1,
    "qty": 2,
    "price": 9.5,
    "note": None,
    "paid": False,
    "blob": b"\x00",
    "state": "NEW",
    "tags": ["a"],
    "attrs": {"k": 3},
    "sig": b"ab",
    "to": {"city": "Oslo"},
    "from_": {"city": "Bergen"},
}

# Values to put in each field: right and wrong types, edges of ranges, and values of neighbouring types.
CANDIDATES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**63 - 1,
    2**63,
    2**53 + 1,
    1.5,
    float("nan"),
    "",
    "NEW",
    "OTHER",
    b"",
    b"ab",
    b"abc",
    bytearray(b"ab"),
    [],
    ["a"],
    [1],
    ("a",),
    {},
    {"k": 3},
    {"k": "x"},
    {1: 3},
    {"city": "x"},
    {"city": "x", "zip": "1"},
    {"city": 1},
]


def accepted(payload: Any) -> bool:
    try:
        avro.validate(SCHEMA, payload)
    except PayloadValidationError:
        return False
    return True


def test_the_quick_test_passes_a_typical_payload() -> None:
    check = avro.compile_check(SCHEMA)
    assert check is not None
    assert check(VALID) and accepted(VALID)


@pytest.mark.parametrize("field", list(VALID))
def test_the_quick_test_never_accepts_what_validation_refuses(field: str) -> None:
    check = avro.compile_check(SCHEMA)
    assert check is not None
    quick = 0
    for value in CANDIDATES:
        payload = dict(VALID, **{field: value})
        if check(payload):
            quick += 1
            assert accepted(payload), f"{field}={value!r} passed the quick test but not validation"
    assert quick >= 1  # the field's own kind of value is among the candidates
    missing = {k: v for k, v in VALID.items() if k != field}
    assert not check(missing)  # a missing field (even with a default) goes to full validation
    assert not check(dict(VALID, extra=1))


def test_records_with_logical_types_or_recursion_get_no_quick_test() -> None:
    logical = avro.parse(
        {
            "type": "record",
            "name": "L",
            "fields": [{"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}}],
        }
    )
    recursive = avro.parse(
        {"type": "record", "name": "Node", "fields": [{"name": "next", "type": ["null", "Node"]}]}
    )
    assert avro.compile_check(logical) is None
    assert avro.compile_check(recursive) is None


def test_nested_containers_are_checked_item_by_item() -> None:
    check = avro.compile_check(SCHEMA)
    assert check is not None
    for tags, attrs in itertools.product((["a", 1], ["a", "b"]), ({"k": 1, "j": "x"}, {"k": 1})):
        payload = dict(VALID, tags=tags, attrs=attrs)
        assert check(payload) == accepted(payload)


@pytest.mark.parametrize("field", list(VALID))
def test_the_compiled_writer_writes_what_fastavro_writes(field: str) -> None:
    check, write = avro.compile_check(SCHEMA), avro.compile_writer(SCHEMA)
    assert check is not None and write is not None
    written = 0
    for value in [*CANDIDATES, "ünïcode", -(2**63), 2**40, -(2**20), 1e300, ["a", "b" * 200], {"a": 1, "b": -2}]:
        payload = {**VALID, field: value}
        if check(payload):  # the writer is used only for what the quick test passes
            assert write(payload) == avro.encode(SCHEMA, payload), (field, value)
            written += 1
    assert written > 0


def test_schemas_the_quick_test_does_not_cover_get_no_compiled_writer() -> None:
    timestamp = {"type": "long", "logicalType": "timestamp-millis"}
    for field_type in (timestamp, ["string", "long"], ["null", "string", "long"]):
        schema = avro.parse({"type": "record", "name": "R", "fields": [{"name": "f", "type": field_type}]})
        assert avro.compile_writer(schema) is None
