"""A 3-broker cluster loses a broker to kill -9 under a steady load: nothing lost, nothing doubled.

The cluster is this module's own (`compose/stack start kafka --brokers 3` in a temporary state dir, on free
ports); Postgres and the registry are the test session's. A producer process enqueues transactional Ledger
tasks at a steady pace and two workers run them while one broker is killed and brought back. Neither the
producer nor the workers are restarted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from taskq._core.db import Database
from taskq._core.envelope import Envelope, Topics
from taskq._core.kafka import Admin, Source
from taskq._core.settings import Settings
from taskq.producer.admin import create_topics
from taskq.schemas import Registry
from tests.acceptance.conftest import App
from tests.acceptance.helpers import (
    WorkerProcess,
    all_committed,
    private_ports,
    tier_records,
    uncommitted,
    wait_until,
)
from tests.conftest import REPO

STACK = REPO / "compose" / "stack"
BROKERS = 3
#: The module's tests share one cluster (module-scoped): under xdist they run on one worker, in order.
pytestmark = pytest.mark.xdist_group("cluster")


class Cluster:
    """A 3-node Kafka of compose/stack: its state dir, its ports, its bootstrap servers."""

    def __init__(self, state: Path) -> None:
        # 3 client ports, then 3 controller ports, then 3 SASL_SSL ports, all consecutive (compose/stack's
        # cluster layout).
        base = private_ports(3 * BROKERS)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TASKQ_")},
            "TASKQ_STACK_DIR": str(state),
            "TASKQ_STACK_KAFKA_PORT": str(base),
            "TASKQ_STACK_KAFKA_CONTROLLER_PORT": str(base + BROKERS),
            "TASKQ_STACK_KAFKA_SASL_PORT": str(base + 2 * BROKERS),
        }
        self.bootstrap = ",".join(f"127.0.0.1:{base + i}" for i in range(BROKERS))

    def run(self, *args: str) -> str:
        """`compose/stack ARGS` against this cluster; its stdout, failing with its stderr."""
        done = subprocess.run(
            [str(STACK), *args], env=self.env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, (
            f"compose/stack {' '.join(args)} failed ({done.returncode}):\n{done.stderr}"
        )
        return done.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three Kafka nodes of this module's own, started once and always stopped at the end."""
    c = Cluster(tmp_path_factory.mktemp("cluster") / "stack")
    try:
        out = c.run("start", "kafka", "--brokers", str(BROKERS))
        assert f"export TASKQ_BOOTSTRAP_SERVERS={c.bootstrap}" in out.splitlines()
        yield c
    finally:
        # Its data is thrown away: no need for the nodes' orderly shutdown.
        subprocess.run([str(STACK), "kill", "kafka"], env=c.env, check=False, timeout=60, capture_output=True)


@pytest.fixture
def cluster_app(cluster: Cluster, stack_env: dict[str, str], tmp_path: Path) -> Iterator[App]:
    """The test app in a fresh namespace: topics on the cluster, schemas and ledger on the session's stack."""
    ns = "c" + uuid.uuid4().hex[:10]
    settings = Settings.from_env(
        {
            "TASKQ_BOOTSTRAP_SERVERS": cluster.bootstrap,
            "TASKQ_SCHEMA_REGISTRY_URL": stack_env["TASKQ_SCHEMA_REGISTRY_URL"],
            "TASKQ_DATABASE_URL": stack_env["TASKQ_DATABASE_URL"],
        },
        namespace=ns,
        database_schema=ns,
    )
    create_topics(settings, partitions=3)  # no replication given: the cluster's default, 3
    db = Database(settings.database_url, schema=settings.database_schema)
    db.migrate()

    def env_of(**extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKQ_", "PG"))}
        return {
            **env,
            "TASKQ_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "TASKQ_SCHEMA_REGISTRY_URL": settings.schema_registry_url,
            "TASKQ_DATABASE_URL": settings.database_url,
            "TASKQ_NAMESPACE": ns,
            "TASKQ_DATABASE_SCHEMA": ns,
            "PYTHONPATH": str(REPO),
            **extra,
        }

    app = App(settings, env_of, tmp_path)
    try:
        yield app
    finally:
        app.close()
        db.drop_schema()
        with Registry(settings.schema_registry_url) as registry:
            for subject in registry.subjects():
                if subject.startswith(ns + "."):
                    registry.delete_subject(subject)


def _topics(settings: Settings) -> list[str]:
    t = Topics(settings.namespace, settings.delay_tiers)
    return [*t.priority_topics, *t.delay_topics, t.dlq]


def _replicas(settings: Settings) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(topic, partition) -> (leader, replicas, in-sync replicas) of the namespace's topics."""
    md = AdminClient({"bootstrap.servers": settings.bootstrap_servers}).list_topics(timeout=10)
    return {
        (name, p): (part.leader, len(part.replicas), len(part.isrs))
        for name in _topics(settings)
        for p, part in md.topics[name].partitions.items()
    }


def _offsets(settings: Settings) -> dict[tuple[str, int], tuple[int, int]] | None:
    """(topic, partition) -> (end offset, the worker group's committed offset) of the priority topics."""
    # The group's offsets through a consumer of that group that never joins it, not the admin client:
    # confluent-kafka 2.16's first admin query of group offsets on a fresh broker can crash the process.
    source = None
    try:
        end = Admin(settings, timeout=5.0).end_offsets(Topics(settings.namespace).priority_topics)
        source = Source(settings, group=settings.worker_group)
        committed = source.committed(end, timeout=5.0)  # a coordinator on the dead broker: ask again soon
    except Exception:  # a broker away, a coordinator moving: not yet
        return None
    finally:
        if source is not None:
            source.close()
    return {tp: (offset, committed.get(tp, -1)) for tp, offset in end.items()}


def _done(app: App) -> int:
    return int(app.scalar("SELECT count(DISTINCT key) FROM ledger"))


def _alive(app: App) -> None:
    dead = [(w.log.name, w.proc.returncode) for w in app.workers if w.proc.poll() is not None]
    assert not dead, f"processes died: {dead}\n{app.logs()}"


def _on_the_topics(app: App, topics: Sequence[str] = ()) -> Counter[str]:
    """Idempotency keys of every committed record on the priority topics (or `topics`), counted."""
    records = tier_records(app.settings, topics)
    return Counter(Envelope.from_headers(r.headers).idempotency_key for r in records)


def _doubles(app: App, keys: set[str]) -> str:
    """Where the copies of `keys` are on the priority topics, how many the delay topics hold, and what the
    forwarders logged about their transactions: enough to tell a forwarder's double from a producer's."""
    copies = [
        f"{key} {r.topic}[{r.tp[1]}]@{r.offset} ts={r.timestamp_ms}"
        for r in tier_records(app.settings)
        if (key := Envelope.from_headers(r.headers).idempotency_key) in keys
    ]
    delayed = _on_the_topics(app, Topics(app.settings.namespace, app.settings.delay_tiers).delay_topics)
    logged = [
        line
        for w in app.workers
        for line in w.output().splitlines()
        if "forward" in line or "transaction" in line
    ]
    on_delay = {k: delayed[k] for k in keys}
    lines = ["copies on the priority topics:", *sorted(copies), f"on the delay topics: {on_delay}"]
    return "\n".join([*lines, "forwarder lines:", *logged[-60:]])


def test_topics_on_the_cluster_get_three_replicas_and_two_in_sync(cluster_app: App) -> None:
    replicas = _replicas(cluster_app.settings)
    assert replicas and {(r, isr) for _, r, isr in replicas.values()} == {(3, 3)}, replicas
    admin = AdminClient({"bootstrap.servers": cluster_app.settings.bootstrap_servers})
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in _topics(cluster_app.settings)]
    for resource, future in admin.describe_configs(resources).items():
        assert future.result()["min.insync.replicas"].value == "2", resource


def test_a_broker_killed_under_load_loses_nothing_and_doubles_nothing(
    cluster: Cluster, cluster_app: App, tmp_path: Path
) -> None:
    app = cluster_app
    for _ in range(2):
        app.spawn("--concurrency", "4")
    stop = tmp_path / "stop-producing"
    producer = WorkerProcess(
        app.env_of(),
        tmp_path / "producer.log",
        command=(str(stop), "40"),
        taskq=(sys.executable, "-m", "tests.apps.steady_producer"),
    )
    app.workers.append(producer)
    wait_until(lambda: _done(app) >= 40, timeout=60, what="steady progress before the failure")
    # Both workers settled in the group first: the failure, not their joining, is what moves partitions.
    wait_until(
        lambda: all(re.search(r"assigned \S", w.output()) for w in app.workers[:2]),
        timeout=60,
        what="both workers to own partitions",
    )

    # The node that leads the most of the namespace's partitions dies the hardest way there is.
    leaders = Counter(leader for leader, _, _ in _replicas(app.settings).values())
    victim = f"kafka-{leaders.most_common(1)[0][0]}"
    before = wait_until(lambda: _offsets(app.settings), timeout=30, what="the offsets before the failure")
    cluster.run("kill", victim)

    def moved_on() -> bool:
        # Every partition, the victim's included, is written to and worked past where it was: its other
        # replicas took over, and so did the coordinators of the group and of the producers.
        now = _offsets(app.settings)
        return now is not None and all(
            now[tp][0] > end and now[tp][1] > done for tp, (end, done) in before.items()
        )

    wait_until(
        moved_on, timeout=60, what=f"every partition written and committed with {victim} dead", every=1.0
    )
    _alive(app)
    cluster.run("start", victim)

    def healed() -> bool:
        return all(isr == 3 for _, _, isr in _replicas(app.settings).values())

    wait_until(healed, timeout=60, what=f"{victim} back in every partition's in-sync replicas", every=1.0)
    back_at = _done(app)
    wait_until(lambda: _done(app) >= back_at + 40, timeout=60, what="progress after the broker came back")
    _alive(app)

    stop.touch()
    assert producer.wait(120) == 0, app.logs()
    m = re.search(r"enqueued (\d+)", producer.output())
    assert m, producer.output()
    keys = [f"steady-{i}" for i in range(int(m.group(1)))]
    wait_until(lambda: _done(app) == len(keys), timeout=120, what="every key run")
    try:
        wait_until(lambda: all_committed(app.settings), timeout=60, what="the group to commit every offset")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: uncommitted records {uncommitted(app.settings)}\n{app.logs()}"
        ) from None
    app.assert_once_each(keys)
    assert app.scalar("SELECT count(*) FROM ledger") == len(keys)
    # Every task is on the priority topics, and the forwarders' transactions forwarded no delayed task
    # (every fourth) twice. A record the producer sent as the leader died can be written twice by the
    # client's retry (seen once: two copies side by side on one partition, of one timestamp to the
    # millisecond); its key still takes effect once (above). Such a copy is the one produce() call written
    # twice; a forwarded copy carries the time of its forwarding, so a second forwarding of a task shows as
    # copies of different timestamps, and fails here.
    records = tier_records(app.settings)
    on_topics = Counter(Envelope.from_headers(r.headers).idempotency_key for r in records)
    expected = [f"ledger:{k}" for k in keys]
    assert set(on_topics) == set(expected), f"missing {sorted(set(expected) - set(on_topics))[:10]}"
    doubled = {k for k, n in on_topics.items() if n > 1}
    stamps = {
        k: {r.timestamp_ms for r in records if Envelope.from_headers(r.headers).idempotency_key == k}
        for k in doubled
    }
    forwarded_twice = {k for k, at in stamps.items() if len(at) > 1}
    assert not forwarded_twice, f"forwarded twice: {forwarded_twice}\n{_doubles(app, forwarded_twice)}"
    dead = [w.log.name for w in app.workers if w is not producer and w.proc.poll() is not None]
    assert not dead, f"workers died: {dead}\n{app.logs()}"
