"""Pure producer logic: the envelope headers, derived idempotency keys, Settings, Avro validation and framing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from taskq import PayloadValidationError, Settings, derive_idempotency_key
from taskq._core.envelope import Envelope, EnvelopeError, Topics
from taskq._core.errors import KafkaAuthenticationError
from taskq._core.kafka import (
    LIBRDKAFKA_LOG,
    base_config,
    consumer_config,
    producer_config,
    share_consumer_config,
)
from taskq.schemas import DecodeError, avro

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ envelope
def _full_envelope() -> Envelope:
    return Envelope(
        task_id="t-1",
        task_type="demo.SendEmail",
        idempotency_key="email:42",
        priority="high",
        attempt=3,
        max_attempts=5,
        enqueued_at=datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
        not_before=datetime(2026, 1, 2, 3, 5, 0, tzinfo=UTC),
        timeout=2.5,
        origin_topic="ns.high",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )


def test_envelope_round_trips_through_headers():
    env = _full_envelope()
    headers = env.to_headers()
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in headers)
    assert dict(headers)["taskq-not-before"] == b"1767323100000"
    assert Envelope.from_headers(headers) == env


def test_minimal_envelope_round_trips_and_leaves_optional_headers_out():
    env = Envelope(
        task_id="t-2",
        task_type="demo.SendEmail",
        idempotency_key="k",
        priority="low",
        enqueued_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    names = {k for k, _ in env.to_headers()}
    assert not names & {"taskq-max-attempts", "taskq-not-before", "taskq-timeout", "traceparent"}
    assert Envelope.from_headers(env.to_headers()) == env


def test_enqueued_at_keeps_millisecond_precision():
    at = datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    env = dataclasses.replace(_full_envelope(), enqueued_at=at)
    assert Envelope.from_headers(env.to_headers()).enqueued_at == at.replace(microsecond=123000)


def test_unknown_headers_are_ignored_and_the_last_value_wins():
    headers = [("other", b"x"), ("taskq-attempt", b"1"), *_full_envelope().to_headers()]
    assert Envelope.from_headers(headers).attempt == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h.pop("taskq-task-id"), "'taskq-task-id' is missing"),
        (lambda h: h.pop("taskq-attempt"), "'taskq-attempt' is missing"),
        (lambda h: h.update({"taskq-priority": b"urgent"}), "'urgent'"),
        (lambda h: h.update({"taskq-attempt": b"two"}), "malformed"),
        (lambda h: h.update({"taskq-enqueued-at": b"yesterday"}), "malformed"),
        (lambda h: h.update({"taskq-task-type": b"\xff"}), "malformed"),
        (lambda h: h.update({"taskq-idempotency-key": b"a\x00b"}), "taskq-idempotency-key contains a NUL byte"),
        (lambda h: h.update({"taskq-task-id": b"\x00"}), "taskq-task-id contains a NUL byte"),
    ],
)
def test_a_broken_envelope_names_the_header(change, message):
    headers = dict(_full_envelope().to_headers())
    change(headers)
    with pytest.raises(EnvelopeError, match=message):
        Envelope.from_headers(list(headers.items()))


def test_topic_names():
    topics = Topics("ns", (timedelta(seconds=1), timedelta(seconds=30), timedelta(minutes=2)))
    assert topics.priority_topics == ["ns.critical", "ns.high", "ns.normal", "ns.low"]
    assert topics.delay_topics == ["ns.delay.1s", "ns.delay.30s", "ns.delay.2m"]
    assert topics.dlq == "ns.dlq"
    assert topics.priority_of("ns.low") == "low"
    assert topics.priority_of("ns.delay.1s") is None
    assert topics.priority_of("other.low") is None


# ------------------------------------------------------------------------------------- idempotency keys
def test_derived_key_is_deterministic_and_ignores_key_order():
    a = derive_idempotency_key("demo.SendEmail", {"to": "a@example.com", "subject": "hi", "n": 1})
    b = derive_idempotency_key("demo.SendEmail", {"n": 1, "subject": "hi", "to": "a@example.com"})
    assert a == b
    assert a.startswith("demo.SendEmail:")
    assert len(a.split(":", 1)[1]) == 32


def test_derived_key_differs_by_payload_and_by_task_type():
    base = derive_idempotency_key("demo.SendEmail", {"to": "a@example.com"})
    assert derive_idempotency_key("demo.SendEmail", {"to": "b@example.com"}) != base
    assert derive_idempotency_key("demo.Other", {"to": "a@example.com"}) != base
    nested_a = derive_idempotency_key("t", {"x": {"a": 1, "b": [1, 2]}})
    assert nested_a == derive_idempotency_key("t", {"x": {"b": [1, 2], "a": 1}})
    assert nested_a != derive_idempotency_key("t", {"x": {"a": 1, "b": [2, 1]}})


def test_derived_key_encodes_avro_values_canonically():
    payload = {
        "raw": b"\x00\xff",
        "at": datetime(2026, 1, 1, tzinfo=UTC),
        "day": date(2026, 1, 1),
        "amount": Decimal("10.50"),
        "id": uuid.UUID(int=7),
        "text": "grüße",
    }
    assert derive_idempotency_key("t", payload) == derive_idempotency_key("t", dict(payload))
    assert derive_idempotency_key("t", {"raw": b"\x00\xff"}) != derive_idempotency_key(
        "t", {"raw": b"\x00\xfe"}
    )
    with pytest.raises(TypeError, match="object"):
        derive_idempotency_key("t", {"x": object()})


def test_derived_key_is_the_same_in_another_process():
    payload = {"to": "a@example.com", "tags": {"b": 2, "a": 1}}
    code = (
        "from taskq import derive_idempotency_key as d;"
        "print(d('demo.SendEmail', {'tags': {'a': 1, 'b': 2}, 'to': 'a@example.com'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == derive_idempotency_key("demo.SendEmail", payload)


# ------------------------------------------------------------------------------------------------ settings
def test_settings_defaults_point_at_the_local_stack():
    s = Settings()
    assert s.bootstrap_servers == "127.0.0.1:19092"
    assert s.namespace == "taskq"
    assert s.worker_group == "taskq.workers"
    assert s.delay_tiers[0] == timedelta(seconds=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.namespace = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": "has space"}, "namespace 'has space'"),
        ({"namespace": ""}, "namespace ''"),
        ({"namespace": "x" * 201}, "at most 200"),
        ({"database_schema": "Bad-Schema"}, "database_schema 'Bad-Schema'"),
        ({"bootstrap_servers": ""}, "bootstrap_servers"),
        ({"delay_tiers": ()}, "delay_tiers"),
        # Not a network failure ("unreachable: Name or service not known"), and no secret in the message.
        (
            {"schema_registry_url": "ftp://u:s3cret@registry"},
            r"^schema_registry_url must be an http:// or https:// URL, got 'ftp://u:\*\*\*@registry'$",
        ),
        ({"schema_registry_url": "registry:8081"}, "schema_registry_url must be an http:// or https:// URL"),
        ({"delay_tiers": (timedelta(seconds=-1),)}, "delay_tiers"),
        ({"kafka": {"acks": "1"}}, r"\['acks'\]"),
        ({"kafka": {"enable.idempotence": "false"}}, "enable.idempotence"),
    ],
)
def test_settings_are_validated_when_created(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)


def test_a_delay_tier_that_is_no_positive_duration_is_named_in_seconds_not_as_a_python_repr():
    # TASKQ_DELAY_TIERS=0 said "got (datetime.timedelta(0),)".
    with pytest.raises(ValueError) as refused:
        Settings(delay_tiers=(timedelta(0), timedelta(seconds=5)))
    assert str(refused.value) == "delay_tiers must be positive durations, got 0s, 5s"


def test_settings_sort_delay_tiers_and_freeze_kafka_properties():
    props = {"security.protocol": "SASL_SSL"}
    s = Settings(
        delay_tiers=(timedelta(seconds=30), timedelta(seconds=1), timedelta(seconds=30)), kafka=props
    )
    assert s.delay_tiers == (timedelta(seconds=1), timedelta(seconds=30))
    props["security.protocol"] = "PLAINTEXT"
    assert s.kafka["security.protocol"] == "SASL_SSL"
    with pytest.raises(TypeError):
        s.kafka["sasl.mechanism"] = "PLAIN"  # type: ignore[index]


def test_settings_from_env_reads_taskq_variables_and_overrides_win():
    env = {
        "TASKQ_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
        "TASKQ_SCHEMA_REGISTRY_URL": "http://registry:8081",
        "TASKQ_DATABASE_URL": "postgresql://u@db/taskq",
        "TASKQ_NAMESPACE": "orders",
        "TASKQ_DATABASE_SCHEMA": "orders_q",
        "TASKQ_DELAY_TIERS": "5s,1m",
        "KAFKA_BOOTSTRAP_SERVERS": "ignored:1",
        "TASKQ_WORKER_GROUP": "",
    }
    s = Settings.from_env(env)
    assert (s.bootstrap_servers, s.schema_registry_url, s.database_url) == (
        "k1:9092,k2:9092",
        "http://registry:8081",
        "postgresql://u@db/taskq",
    )
    assert (s.namespace, s.database_schema, s.worker_group) == ("orders", "orders_q", "orders.workers")
    assert s.delay_tiers == (timedelta(seconds=5), timedelta(minutes=1))
    assert Settings.from_env(env, namespace="billing").namespace == "billing"
    assert Settings.from_env({"TASKQ_WORKER_GROUP": "g"}).worker_group == "g"


def test_settings_from_env_passes_taskq_kafka_variables_through_to_librdkafka():
    env = {
        "TASKQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "TASKQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "TASKQ_KAFKA_SASL_USERNAME": "svc",
        "TASKQ_KAFKA_SSL_CA_LOCATION": "/etc/ca.pem",
    }
    s = Settings.from_env(env)
    assert dict(s.kafka) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "svc",
        "ssl.ca.location": "/etc/ca.pem",
    }
    conf = base_config(s)
    assert conf == {
        "bootstrap.servers": s.bootstrap_servers,
        "logger": LIBRDKAFKA_LOG,
        "error_cb": conf["error_cb"],
        "reconnect.backoff.ms": 20,
        **s.kafka,
    }


@pytest.mark.parametrize("protocol", ["consumer", "classic"])
def test_every_client_config_carries_the_kafka_settings(protocol: str) -> None:
    # Producers (the forwarder's transactional one too), consumers (the worker's, the forwarder's, the DLQ
    # reader's) and the admin client are all built from these, so TASKQ_KAFKA_* reaches every one.
    env = {"TASKQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "TASKQ_KAFKA_SASL_PASSWORD": "pw"}
    s = Settings.from_env({**env, "TASKQ_GROUP_PROTOCOL": protocol})
    for conf in (base_config(s), producer_config(s), consumer_config(s, group="g")):
        assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.password"] == "pw"
        assert conf["error_cb"] is base_config(s)["error_cb"]


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed (password=hunter2)"),
        (KafkaError._SSL, "SSL handshake failed: certificate verify failed"),
    ],
)
def test_every_client_raises_when_kafka_refuses_its_settings(code: int, text: str) -> None:
    # librdkafka retries a refused login for ever; the error callback of every client (producer, consumer,
    # admin, forwarder, DLQ tools all start from base_config) raises it instead, in the call that serves it.
    on_error = base_config(Settings())["error_cb"]
    with pytest.raises(KafkaAuthenticationError, match="Kafka refused the connection") as refused:
        on_error(KafkaError(code, text))
    assert "hunter2" not in str(refused.value)
    on_error(KafkaError(KafkaError._TRANSPORT, "1/1 brokers are down"))  # retried by the client: no raise


def test_settings_from_env_refuses_kafka_variables_that_would_break_a_guarantee():
    with pytest.raises(ValueError, match="acks"):
        Settings.from_env({"TASKQ_KAFKA_ACKS": "0"})
    with pytest.raises(ValueError, match="enable.auto.commit"):
        Settings.from_env({"TASKQ_KAFKA_ENABLE_AUTO_COMMIT": "true"})
    # Read uncommitted records of aborted forwarder transactions, store offsets before the outcome is
    # durable, start a new group past its backlog, or leave the group taskq joins: each loses or doubles tasks.
    for name in ("ISOLATION_LEVEL", "ENABLE_AUTO_OFFSET_STORE", "AUTO_OFFSET_RESET", "GROUP_ID"):
        with pytest.raises(ValueError, match=name.lower().replace("_", ".")):
            Settings.from_env({f"TASKQ_KAFKA_{name}": "x"})


@pytest.mark.parametrize("protocol", ["consumer", "classic"])
def test_kafka_variables_override_the_tuning_defaults_of_every_client(protocol: str) -> None:
    # linger.ms, compression and fetch waits are defaults chosen for a workload: a user who measured theirs
    # sets them through TASKQ_KAFKA_*, and the setting must reach the client, not be silently replaced.
    env = {
        "TASKQ_KAFKA_LINGER_MS": "0",
        "TASKQ_KAFKA_COMPRESSION_TYPE": "zstd",
        "TASKQ_KAFKA_FETCH_WAIT_MAX_MS": "50",
        "TASKQ_KAFKA_QUEUED_MAX_MESSAGES_KBYTES": "4096",
        "TASKQ_GROUP_PROTOCOL": protocol,
    }
    s = Settings.from_env(env)
    producer = producer_config(s)
    assert (producer["linger.ms"], producer["compression.type"]) == ("0", "zstd")
    assert (producer["acks"], producer["enable.idempotence"]) == ("all", True)
    consumer = consumer_config(s, group="g")
    assert (consumer["fetch.wait.max.ms"], consumer["queued.max.messages.kbytes"]) == ("50", "4096")
    # The default left alone: a fetch waits up to 5 ms for 4 KB, so a steady rate's records come several at
    # once (one record a fetch woke the client's threads, the loop and a claim's round trip per task).
    assert consumer["fetch.min.bytes"] == 4096 and consumer_config(Settings(), group="g")["fetch.wait.max.ms"] == 5
    assert (consumer["group.id"], consumer["isolation.level"]) == ("g", "read_committed")
    assert consumer["enable.auto.commit"] is False and consumer["enable.auto.offset.store"] is False
    # Every client reconnects after 20 ms, not librdkafka's 100: a new client connects to the brokers the
    # bootstrap one named after half of it (a new consumer's join waited 50 ms for it in one start of two).
    for conf in (producer, consumer, share_consumer_config(s, group="g", max_poll_records=4)):
        assert conf["reconnect.backoff.ms"] == 20
    chosen = Settings.from_env({**env, "TASKQ_KAFKA_RECONNECT_BACKOFF_MS": "100"})
    assert producer_config(chosen)["reconnect.backoff.ms"] == "100"


def test_a_share_consumer_takes_the_settings_meant_for_every_consumer() -> None:
    # TASKQ_KAFKA_* tuning of the group consumers (session timeout, fetch queue) is refused by librdkafka's
    # share consumer; it is left out of the share consumer's settings, and the security settings stay.
    from confluent_kafka import ShareConsumer

    env = {
        "TASKQ_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
        "TASKQ_KAFKA_SESSION_TIMEOUT_MS": "20000",
        "TASKQ_KAFKA_QUEUED_MAX_MESSAGES_KBYTES": "4096",
        "TASKQ_KAFKA_ENABLE_PARTITION_EOF": "true",
    }
    conf = share_consumer_config(Settings.from_env(env), group="g", max_poll_records=4)
    assert conf["security.protocol"] == "PLAINTEXT"
    assert (conf["share.acknowledgement.mode"], conf["max.poll.records"]) == ("explicit", 4)
    for name in ("session.timeout.ms", "queued.max.messages.kbytes", "enable.partition.eof"):
        assert name not in conf
    ShareConsumer({**conf, "bootstrap.servers": "127.0.0.1:1"}).close()  # raises on a refused property
    with pytest.raises(ValueError, match="not applicable for share consumer"):
        ShareConsumer({**conf, "bootstrap.servers": "127.0.0.1:1", "isolation.level": "read_committed"})


def test_settings_from_env_reports_a_bad_delay_tier():
    with pytest.raises(ValueError, match="'soon'"):
        Settings.from_env({"TASKQ_DELAY_TIERS": "5s,soon"})


def test_with_namespace_gets_its_own_worker_group():
    s = Settings(namespace="a", worker_group="custom").with_namespace("b")
    assert (s.namespace, s.worker_group) == ("b", "b.workers")


# ------------------------------------------------------------------------------------------------ avro
SCHEMA = avro.parse(
    {
        "type": "record",
        "name": "Order",
        "namespace": "shop",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "qty", "type": "int"},
            {"name": "note", "type": ["null", "string"], "default": None},
            {
                "name": "address",
                "type": {"type": "record", "name": "Address", "fields": [{"name": "city", "type": "string"}]},
            },
            {"name": "lines", "type": {"type": "array", "items": "shop.Address"}, "default": []},
        ],
    }
)
VALID = {"id": "o-1", "qty": 2, "address": {"city": "Oslo"}}


def _invalid(payload):
    with pytest.raises(PayloadValidationError) as info:
        avro.validate(SCHEMA, payload, task_type="shop.Order")
    return info.value


def test_valid_payloads_pass():
    avro.validate(SCHEMA, VALID, task_type="shop.Order")
    avro.validate(SCHEMA, {**VALID, "note": "x", "lines": [{"city": "Bergen"}]}, task_type="shop.Order")


@pytest.mark.parametrize(
    ("payload", "field", "message"),
    [
        ({**VALID, "qty": "two"}, "qty", "field 'qty' is 'two', expected int"),
        ({**VALID, "qty": 2**40}, "qty", "expected int"),
        ({**VALID, "id": None}, "id", "field 'id' is None, expected string"),
        ({"qty": 2, "address": {"city": "Oslo"}}, "id", "required field 'id' is missing"),
        ({**VALID, "colour": "red"}, "colour", "field 'colour' is not in the schema (fields: id, qty, note"),
        ({**VALID, "note": 3}, "note", "expected null or string"),
        ({**VALID, "address": {}}, "address.city", "required field 'address.city' is missing"),
        (
            {**VALID, "address": {"city": "Oslo", "zip": "1"}},
            "address.zip",
            "'address.zip' is not in the schema",
        ),
        ({**VALID, "lines": [{"city": "A"}, {}]}, "lines[1].city", "'lines[1].city' is missing"),
    ],
)
def test_invalid_payloads_name_the_field_and_the_problem(payload, field, message):
    err = _invalid(payload)
    assert err.field == field
    assert err.task_type == "shop.Order"
    assert message in str(err)
    assert str(err).startswith("invalid payload for shop.Order: ")


def test_a_payload_that_is_not_a_mapping_is_refused():
    err = _invalid(["o-1", 2])
    assert "expected an object (mapping), got list" in str(err)


def test_frame_and_split_frame_round_trip():
    body = avro.encode(SCHEMA, VALID)
    value = avro.frame(258, body)
    assert value[:5] == b"\x00\x00\x00\x01\x02"
    assert avro.split_frame(value) == (258, body)
    assert avro.decode(body, SCHEMA) == {**VALID, "note": None, "lines": []}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "tombstone"),
        (b"", "0 bytes is too short"),
        (b"\x00\x00\x01", "3 bytes is too short"),
        (b"\x01\x00\x00\x00\x01abc", "byte 0x01, not the Confluent magic byte"),
        (b'{"id": 1}', "byte 0x7b"),
    ],
)
def test_split_frame_refuses_what_is_not_confluent_framed(value, message):
    with pytest.raises(DecodeError, match=message):
        avro.split_frame(value)


def test_decode_refuses_trailing_bytes_and_truncated_bodies():
    body = avro.encode(SCHEMA, VALID)
    with pytest.raises(DecodeError, match="trailing"):
        avro.decode(body + b"\x00", SCHEMA)
    with pytest.raises(DecodeError):
        avro.decode(body[:3], SCHEMA)
