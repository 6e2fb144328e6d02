"""Share mode (experimental): `taskq worker --share-group` reads the tiers through share groups (KIP-932),
so workers share partitions and a slow task holds back no other; every key still takes effect once."""

from __future__ import annotations

import urllib.request
from dataclasses import replace

import pytest

from taskq._core.envelope import Priority
from taskq._core.kafka import Admin, KafkaBroker
from taskq.consumer.shares import DELIVERY_LIMIT, SEND_AGAIN_BEFORE, TierShares, share_group
from taskq.producer.producer import TaskProducer, TaskSpec
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, private_ports, wait_until


def _spawn(app: App, *args: str) -> WorkerProcess:
    """A worker in share mode, running the app's handlers but the ordered one."""
    log = app.tmp_path / f"worker-{len(app.workers)}.log"
    w = WorkerProcess.command(
        app.env_of(), log, "worker", "tests.apps.app:share_handlers", "--share-group", *args
    )
    app.workers.append(w)
    return w


def _enqueue(app: App, keys: list[str], *, sleep: float = 0.0, priority: Priority = "normal") -> None:
    """Ledger tasks, one key each, sent a few records per producer batch: librdkafka's share consumer
    acquires whole batches (it has no record-limit mode), and small ones let every member take a share."""
    settings = replace(app.settings, kafka={**app.settings.kafka, "batch.num.messages": "4"})
    specs = [
        TaskSpec(
            task_type=app.type("Ledger"),
            payload={"key": k, "amount": i, "sleep": sleep},
            idempotency_key=f"ledger:{k}",
            priority=priority,
        )
        for i, k in enumerate(keys)
    ]
    with TaskProducer(settings) as producer:
        for start in range(0, len(specs), 500):
            producer.enqueue_many(specs[start : start + 500])
        producer.flush(60)


def _done(app: App) -> int:
    return int(app.scalar("SELECT count(DISTINCT key) FROM ledger") or 0)


@pytest.mark.partitions(2)
def test_six_workers_share_a_tier_of_two_partitions_and_each_key_takes_effect_once(app: App) -> None:
    keys = [f"k{i}" for i in range(3000)]
    _enqueue(app, keys, sleep=0.03)
    for _ in range(6):
        _spawn(app, "--concurrency", "2", "--no-forwarder", "--no-relay")
    wait_until(lambda: _done(app) == len(keys), timeout=240, what=f"every key\n{app.logs()}", every=1.0)
    app.assert_once_each(keys)
    # In a consumer group, two partitions keep four of the six workers idle; here each took a share.
    shares = {r["worker"]: r["n"] for r in app.query("SELECT worker, count(*) AS n FROM ledger GROUP BY 1")}
    assert len(shares) == 6 and min(shares.values()) >= len(keys) // 10, (shares, app.logs())


@pytest.mark.partitions(1)
def test_fast_tasks_on_the_partition_of_a_slow_one_run_beside_it_on_another_worker(app: App) -> None:
    # The slow task first, on the one partition: whichever worker runs it has its only slot taken, and in
    # a consumer group (one member owns the partition) the tasks behind it would wait for it to end.
    slow = app.producer.enqueue(app.type("Patient"), {"key": "slow"}, priority="normal")
    app.producer.flush(30)
    keys = [f"f{i}" for i in range(200)]
    _enqueue(app, keys)
    for _ in range(2):
        _spawn(app, "--concurrency", "1", "--no-forwarder", "--no-relay")
    wait_until(lambda: _done(app) == len(keys), timeout=120, what=f"the fast tasks\n{app.logs()}", every=1.0)
    # The slow task runs until it is cancelled: every fast one finished beside it.
    state = app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = %s", slow.idempotency_key)
    assert state == "running", state
    app.assert_once_each(keys)
    assert app.producer.cancel(idempotency_key=slow.idempotency_key)
    wait_until(
        lambda: app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = %s", slow.idempotency_key)
        != "running",
        timeout=60,
        what="the slow task to end once cancelled",
    )


def test_a_worker_in_share_mode_refuses_ordered_task_types_with_one_line(app: App) -> None:
    w = WorkerProcess(app.env_of(), app.tmp_path / "refused.log", "--share-group")
    app.workers.append(w)
    assert w.proc.wait(60) != 0
    out = w.output().strip().splitlines()
    assert out and "ordered task types need partition order" in out[-1], out
    assert f"{app.ns}.Ordered" in out[-1] and "Traceback" not in w.output(), out


@pytest.mark.partitions(1)
def test_a_task_near_its_last_delivery_is_sent_again_not_left_to_be_archived(app: App) -> None:
    keys = ["last"]
    topic = app.producer.topics.tier("normal")
    group = share_group(topic)
    admin = Admin(app.settings)
    # A worker gives its groups the most deliveries the cluster allows (each worker death costs every
    # record its consumers held one: the default 5 archived tasks in chaos runs), reads the limit back,
    # and sends a record again SEND_AGAIN_BEFORE deliveries before it. It does so as it joins, before it
    # fetches anything.
    most = int(admin.broker_configs()["group.share.max.delivery.count.limit"])
    assert most > DELIVERY_LIMIT
    joined = TierShares(KafkaBroker(app.settings), consumers=1, max_poll_records=1, on_assign=lambda tps: None)
    joined.subscribe([topic])
    joined.close()
    assert (joined.delivery_limit, joined.send_again_at) == (most, most - SEND_AGAIN_BEFORE)
    send_again_at = most - SEND_AGAIN_BEFORE
    _enqueue(app, keys)
    member = KafkaBroker(app.settings).share_source(group=group, topics=[topic], consumers=1)
    try:
        # Handed out and released until its next delivery is the one the worker sends it again at.
        for delivery in range(1, send_again_at):
            (record,) = wait_until(lambda: member.poll(1, 0.5), timeout=30, what=f"delivery {delivery}")
            assert record.delivery_count == delivery
            member.release(record)
    finally:
        member.close()
    _spawn(app, "--concurrency", "1", "--no-forwarder", "--no-relay")
    wait_until(lambda: _done(app) == 1, timeout=60, what=f"the task\n{app.logs()}", every=0.5)
    app.assert_once_each(keys)
    # The copy sent again is a record of its own on the tier (the one that ran); the original is accepted.
    assert sum(admin.end_offsets([topic]).values()) == 2
    assert f"handed out {send_again_at} times: sent again as a new record" in app.logs()
    assert admin.share_group_configs([group])[group]["share.delivery.count.limit"] == str(most)


def _metric(port: int, name: str) -> float:
    """The sum of a metric's series on a worker's /metrics (0 before it has any)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.partitions(1)
def test_a_task_longer_than_its_lock_runs_once_while_its_record_is_handed_out_again(app: App) -> None:
    # The group's lock is shorter than the task: the record goes to the other worker (or back) while it
    # runs. Nothing renews the lock; the key's lease in Postgres holds the copies until it completes.
    topic = app.producer.topics.tier("normal")
    Admin(app.settings).configure_share_group(share_group(topic), lock_duration_ms=1000)
    keys = ["long"]
    _enqueue(app, keys, sleep=3.5)
    port = private_ports(2)
    for i in range(2):
        _spawn(app, "--concurrency", "2", "--no-forwarder", "--no-relay", "--metrics-port", str(port + i))
    wait_until(lambda: _done(app) == 1, timeout=60, what=f"the task\n{app.logs()}", every=0.5)
    wait_until(
        lambda: app.scalar("SELECT state FROM taskq_tasks WHERE idempotency_key = 'ledger:long'")
        == "completed",
        timeout=30,
        what="its completion",
    )
    redelivered = sum(_metric(port + i, "taskq_share_redeliveries_total") for i in range(2))
    assert redelivered >= 1, app.logs()
    app.assert_once_each(keys)
