"""Kafka's rules as the worker relies on them, the same for InMemoryBroker and the real broker."""

from __future__ import annotations

from collections import defaultdict

import pytest

from taskq._core.errors import RecordTooLargeError
from taskq._core.kafka import TP, Record, RecordSource, TopicSpec
from tests.acceptance.helpers import wait_until
from tests.contract.conftest import Kafka


def produce(kafka: Kafka, n: int, *, keys: int = 10) -> None:
    sink = kafka.broker.sink()
    for i in range(n):
        sink.send(
            kafka.topic, f"v{i}".encode(), key=f"k{i % keys}".encode(), headers=[("i", str(i).encode())]
        )
    assert sink.flush(30) == 0


def drain(source: RecordSource, n: int) -> list[Record]:
    got: list[Record] = []
    wait_until(lambda: got.extend(source.poll(500, 0.2)) or len(got) >= n, timeout=60, what=f"{n} records")
    return got


def test_keyed_records_keep_their_order_in_one_partition(kafka: Kafka) -> None:
    produce(kafka, 30)
    source = kafka.broker.source(group=f"{kafka.ns}.reader")
    source.assign([(kafka.topic, p, 0) for p in range(3)])
    try:
        records = drain(source, 30)
    finally:
        source.close()
    by_key: dict[bytes | None, list[Record]] = defaultdict(list)
    for r in records:
        by_key[r.key].append(r)
    for key, rs in by_key.items():
        assert len({r.partition for r in rs}) == 1, key
        assert [int(r.header("i") or b"0") for r in rs] == sorted(int(r.header("i") or b"0") for r in rs)
    per_partition: dict[int, list[int]] = defaultdict(list)
    for r in records:
        per_partition[r.partition].append(r.offset)
    for offsets in per_partition.values():
        assert offsets == list(range(len(offsets)))


def test_a_group_resumes_from_its_committed_offsets(kafka: Kafka) -> None:
    produce(kafka, 12)
    group = f"{kafka.ns}.workers"
    assigned: list[TP] = []
    first = kafka.broker.source(group=group, on_assign=assigned.extend)
    first.subscribe([kafka.topic])
    records = drain(first, 12)
    assert sorted(assigned) == [(kafka.topic, p) for p in range(3)]
    # Commit all but the last record of partition 0.
    end = {r.tp: r.offset + 1 for r in records}
    tp0 = (kafka.topic, 0)
    end[tp0] -= 1
    first.commit(end)
    first.close()
    assert kafka.broker.admin().committed(group, [kafka.topic]) == end
    second = kafka.broker.source(group=group)
    second.subscribe([kafka.topic])
    try:
        (again,) = drain(second, 1)
    finally:
        second.close()
    assert (again.tp, again.offset) == (tp0, end[tp0])


def test_an_asynchronous_commit_returns_at_once_and_its_outcome_comes_from_a_poll(kafka: Kafka) -> None:
    produce(kafka, 6)
    group = f"{kafka.ns}.workers"
    outcomes: list[tuple[dict[TP, int], str | None]] = []
    source = kafka.broker.source(group=group, on_commit=lambda *outcome: outcomes.append(outcome))
    source.subscribe([kafka.topic])
    try:
        end = {r.tp: r.offset + 1 for r in drain(source, 6)}
        source.commit(end, asynchronous=True)
        assert outcomes == []  # served by a poll, on the polling thread
        wait_until(lambda: not source.poll(1, 0.1) and outcomes, timeout=30, what="the commit's outcome")
        assert outcomes == [(end, None)]
        assert kafka.broker.admin().committed(group, [kafka.topic]) == end
    finally:
        source.close()


def test_pause_stops_a_partition_and_seek_reads_it_again(kafka: Kafka) -> None:
    produce(kafka, 30)
    source = kafka.broker.source(group=f"{kafka.ns}.reader")
    source.assign([(kafka.topic, p, 0) for p in range(3)])
    try:
        tp0 = (kafka.topic, 0)
        source.pause([tp0])
        seen = drain(source, 1)
        wait_until(lambda: seen.extend(source.poll(500, 0.2)) or not source.poll(500, 0.3), timeout=30,
                   what="the unpaused partitions to be read")  # fmt: skip
        assert tp0 not in {r.tp for r in seen}
        source.resume([tp0])
        from_p0 = [r for r in drain(source, 1) if r.tp == tp0]
        assert from_p0 and from_p0[0].offset == 0
        source.seek(tp0, 0)
        assert drain(source, 1)[0].offset == 0
    finally:
        source.close()


def test_a_transaction_publishes_its_records_and_offsets_together_or_not_at_all(kafka: Kafka) -> None:
    produce(kafka, 3, keys=3)
    group = f"{kafka.ns}.forwarder"
    member = kafka.broker.source(group=group)
    member.subscribe([kafka.topic])
    consumed = drain(member, 3)
    offsets = {r.tp: r.offset + 1 for r in consumed}
    sink = kafka.broker.sink(transactional_id=f"{kafka.ns}.txn")
    sink.init_transactions()
    out = f"{kafka.ns}.out"
    kafka.broker.admin().create_topics([TopicSpec(out, 1)])
    try:
        sink.begin()
        sink.send(out, b"aborted", key=None, headers=[])
        sink.commit_offsets_in_transaction(member, offsets)
        sink.abort()
        committed = kafka.broker.admin().committed(group, [kafka.topic])
        assert {tp: committed[tp] for tp in offsets} == dict.fromkeys(offsets, -1)
        sink.begin()
        sink.send(out, b"committed", key=None, headers=[])
        sink.commit_offsets_in_transaction(member, offsets)
        sink.commit()
        committed = kafka.broker.admin().committed(group, [kafka.topic])
        assert {tp: committed[tp] for tp in offsets} == offsets
    finally:
        member.close()
    reader = kafka.broker.source(group=f"{kafka.ns}.reader")  # read_committed: the aborted one never shows
    reader.assign([(out, 0, 0)])
    try:
        values = [r.value for r in drain(reader, 1)]
        values += [r.value for r in reader.poll(500, 1.0)]
    finally:
        reader.close()
    assert values == [b"committed"]


def test_members_of_a_group_split_each_topics_partitions(kafka: Kafka) -> None:
    group = f"{kafka.ns}.workers"
    owned: dict[str, set[TP]] = {"a": set(), "b": set()}
    sources = {}
    for name in ("a", "b"):
        s = kafka.broker.source(
            group=group,
            on_assign=lambda tps, name=name: owned[name].update(tps),
            on_revoke=lambda tps, name=name: owned[name].difference_update(tps),
        )
        s.subscribe([kafka.topic])
        sources[name] = s

    def split() -> bool:
        for s in sources.values():
            s.poll(10, 0.1)
        return bool(owned["a"] and owned["b"]) and len(owned["a"] | owned["b"]) == 3

    try:
        wait_until(split, timeout=60, what="both members to own partitions")
        assert not owned["a"] & owned["b"]
    finally:
        for s in sources.values():
            s.close()


def test_a_record_over_the_producers_size_limit_is_refused_when_sent(kafka: Kafka) -> None:
    sink = kafka.broker.sink()
    with pytest.raises(RecordTooLargeError):
        sink.send(kafka.topic, b"x" * 1_200_000, key=None, headers=[])
    # Raised above the producer's limit (message.max.bytes) the same record is accepted by the broker.
    roomy = kafka.broker.sink(**{"message.max.bytes": 2_000_000})
    roomy.send(kafka.topic, b"x" * 1_040_000, key=None, headers=[])
    assert roomy.flush(30) == 0
