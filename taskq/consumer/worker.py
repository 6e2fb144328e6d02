"""The worker: consume the priority topics in a group, run each task once, commit offsets contiguously.

One thread (the loop) owns the Kafka consumer, the buffers, the offset tracker and the store connection;
handlers run on the executor's slots and report back through a queue. A task's offset becomes committable
only once its outcome is durable: the completion recorded in Postgres, or its retry/DLQ record acknowledged
by the broker (invariant 1).

Longer than 800 lines because the loop's stages (intake, claims, dispatch, outcomes, offsets)
still live here beside the wiring, and each feature that touches a task's path (quarantine, results,
cancellation, workflow steps, share mode's acknowledgements) adds to one of them. They share the loop's
state (buffers, running tasks, offset tracker) and are split by moving that state into the stages: each a
module of its own, taking and returning a batch, in the batch-stage restructuring of the hot path (issue 21,
part 4). Split piecemeal before then, they would only pass that state back and forth.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIServer

from taskq._core.db import Database
from taskq._core.envelope import (
    DEFAULT_WEIGHTS,
    PRIORITIES,
    Priority,
    Topics,
)
from taskq._core.errors import (
    ConfigurationError,
    KafkaAuthenticationError,
    StoreUnavailableError,
    TaskqError,
)
from taskq._core.kafka import TP, Broker, KafkaBroker, Record, RecordSource
from taskq._core.service import ServiceThread, run_in_thread
from taskq._core.settings import Settings
from taskq._core.store import RESULT_MAX_BYTES
from taskq._core.tracing import Tracer
from taskq.consumer import metrics
from taskq.consumer.claims import Claims, Held
from taskq.consumer.completer import Completer
from taskq.consumer.events import (
    AttemptStarted,
    CancelledSkipped,
    Event,
    Hook,
    LoopSampled,
    PartitionsAssigned,
    PartitionsRevoked,
    WorkerStarted,
    WorkerStopped,
)
from taskq.consumer.executor import Executor, Job, Outcome, failure
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.handlers import Handlers, TaskContext
from taskq.consumer.intake import Intake, Task, size
from taskq.consumer.limits import Limits
from taskq.consumer.liveness import Liveness
from taskq.consumer.offsets import Offsets, OffsetTracker
from taskq.consumer.outcomes import Outcomes, checked_result
from taskq.consumer.periodic import PeriodicScheduler, PeriodicSpec
from taskq.consumer.routing import default_worker_id
from taskq.consumer.scheduler import PriorityScheduler
from taskq.consumer.shares import TierShares
from taskq.consumer.store import (
    Finished,
    IdempotencyStore,
    LeaseLostError,
    Member,
    NotStarted,
    Pauses,
    TaskStore,
    WorkerRecord,
)
from taskq.producer.outbox import OutboxRelay
from taskq.producer.producer import TaskProducer
from taskq.schemas.registry import PendingRegistry, Registry, SchemaRegistry, client_config

log = logging.getLogger("taskq.worker")

#: Most transactional attempts in one group commit: each is a subtransaction, and past 64 in one
#: transaction Postgres's snapshots overflow their subtransaction cache (slower for every session).
GROUP_MAX = 50
#: A group starts no member after it has run this long (seconds): slow tasks commit in small groups, and
#: no effect waits long for the rest of its group.
GROUP_WINDOW = 0.05
#: Records taken from Kafka at a time once a tier may be saturated by them, with flow control in between:
#: fewer than the smallest reserve of the default weights, so no tier can take another's place for long.
POLL_CHUNK = 16
#: Dispatch waits at most this long (seconds) for newly assigned partitions' first fetch.
SETTLE = 0.5
#: Share mode: records acquired beyond what can start are released after this long (seconds).
SHED_AFTER = 5.0
#: A wave of group commits waits at most this long (seconds) for the claims in flight.
WAVE_WAIT = 0.05


class GroupRolledBack(TaskqError):
    """The attempt's group commit was rolled back because of another attempt in it; it runs again."""


class ServiceStoppedError(TaskqError):
    """A service the worker runs beside its loop (the delay forwarder, say) stopped on its own."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How a worker runs; validated when created."""

    concurrency: int = 4
    group: str | None = None
    weights: Mapping[Priority, int] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    #: At most this many fetched tasks wait for a slot; beyond it partitions are paused (invariant 5).
    buffer_capacity: int = 500
    #: And at most about this many bytes of them (values and headers): a tier of large records is paused
    #: before it fills the buffer's task count (invariant 5).
    buffer_bytes: int = 64 * 1024 * 1024
    shutdown_timeout: float = 30.0
    revoke_timeout: float = 10.0
    commit_interval: float = 1.0
    #: Lease of a claimed key when its task type has no timeout.
    default_lease: float = 300.0
    #: Keys are claimed as their records arrive, and leased this much longer than the run needs while they
    #: wait for a slot; a task that waited over half of it renews its lease before it starts.
    claim_wait: float = 10.0
    #: The worker's liveness record is written this often (seconds), by a thread of its own.
    heartbeat_interval: float = 3.0
    #: A worker whose heartbeat is older than this (seconds) is presumed dead: the keys it leased are taken
    #: over by the next claim instead of after their leases (invariant 9).
    stale_after: float = 10.0
    metrics_port: int | None = None
    #: Where /metrics listens: loopback unless told otherwise.
    metrics_host: str = "127.0.0.1"
    #: Run the delay forwarder in this process too (a thread); `taskq forwarder` runs it alone.
    forwarder: bool = True
    #: Run the outbox relay in this process too (a thread); `taskq relay` runs it alone.
    relay: bool = True
    #: Run the scheduler of the handlers' periodic tasks in this process (a thread).
    periodic: bool = True
    #: What operators paused (`taskq pause`) is read this often (seconds): one query, never per task.
    pause_interval: float = 2.0
    #: A handler's return value is stored as its result, as JSON of at most this many bytes; a larger or
    #: non-JSON one fails the attempt (to the DLQ: it would fail again), never stored cut short.
    result_max_bytes: int = RESULT_MAX_BYTES
    #: Experimental: read the tiers through share groups (KIP-932, Kafka 4.2+), one per tier topic, instead
    #: of partitions assigned in a consumer group (taskq/consumer/shares.py).
    share_group: bool = False
    #: In share mode: how long the group lets a member hold a record (ms; None: the broker's default).
    share_lock_ms: int | None = None
    worker_id: str = field(default_factory=default_worker_id)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.buffer_capacity < 4:
            raise ConfigurationError(
                f"buffer_capacity must be >= 4 (one task per tier), got {self.buffer_capacity}"
            )
        if self.buffer_bytes < 1024 * 1024:
            raise ConfigurationError(f"buffer_bytes must be >= 1 MiB, got {self.buffer_bytes}")
        for name in (
            "shutdown_timeout",
            "revoke_timeout",
            "commit_interval",
            "default_lease",
            "claim_wait",
            "heartbeat_interval",
            "pause_interval",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.result_max_bytes < 16:
            raise ConfigurationError(f"result_max_bytes must be >= 16, got {self.result_max_bytes}")
        if not self.stale_after >= 2 * self.heartbeat_interval:
            raise ConfigurationError(
                f"stale_after must be at least twice heartbeat_interval ({self.heartbeat_interval} s), "
                f"got {self.stale_after}"
            )


def _key(task: Task) -> tuple[TP, bytes | None]:
    """What an ordered task type serializes on: its partition and message key."""
    return task.record.tp, task.record.key


@cache
def _task_logger(task_type: str) -> logging.Logger:
    """The logger a task type's handlers get (`ctx.logger`): looked up once per type, not per task."""
    return logging.getLogger(f"taskq.task.{task_type}")


class Worker:
    """Runs the handlers of a `Handlers` registry against a namespace's priority topics."""

    def __init__(
        self,
        handlers: Handlers,
        settings: Settings | None = None,
        config: WorkerConfig | None = None,
        *,
        broker: Broker | None = None,
        store: TaskStore | None = None,
        recorder: TaskStore | None = None,
        registry: SchemaRegistry | None = None,
        hooks: Sequence[Hook] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Parts not given are the real ones from `settings`: Kafka, the Postgres store, the registry.

        `recorder` writes outcomes and claims on a thread of its own while the loop goes on: with `store`
        not given, a Postgres store on a connection of its own; with `store` given, none unless given
        (everything is written from the loop's thread).

        Every event goes to the worker's Prometheus hook (`self.metrics`) and then to `hooks`.
        """
        self.handlers = handlers
        self.settings = settings or Settings.from_env()
        self.config = config or WorkerConfig()
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self.group = self.config.group or self.settings.worker_group
        self.worker_id = self.config.worker_id
        self.metrics = metrics.PrometheusHook()
        self._hooks: tuple[Hook, ...] = (self.metrics, *hooks)
        self._tracer = Tracer()
        self._stop = threading.Event()
        self._outcomes: queue.SimpleQueue[tuple[Task, Outcome]] = queue.SimpleQueue()
        self._scheduler: PriorityScheduler[Task] = PriorityScheduler(
            weights=self.config.weights, capacity=self.config.buffer_capacity
        )
        self._offsets = Offsets(self._emit)
        self._running: dict[int, Task] = {}
        self._arrived: list[Task] = []  # decoded this tick, to claim in one round trip
        self._unstarted: list[Task] = []  # left out of a group that stopped early, to release
        # Tasks of a paused task type, claimed and held out of the scheduler until the type is resumed.
        self._on_hold: list[Task] = []
        self._pauses = Pauses()
        self._pauses_read_at = -float("inf")
        # Ordered task types: the task that holds each (partition, key) while it runs or waits to retry.
        self._key_holder: dict[tuple[TP, bytes | None], int] = {}
        self._revoking: set[TP] = set()  # partitions whose revocation is being served
        self._paused: set[TP] = set()
        self._resume_at: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)  # depth a paused tier resumes at
        self._fresh: set[TP] = set()  # assigned since the last flow control: pause state unknown
        self._settling: dict[TP, float] = {}  # assigned, not fetched yet: when they were assigned
        self._dispatched = False  # nothing started yet: the first dispatch waits for every tier's partitions
        self._first_assigned: float | None = None
        self._fed: dict[Priority, float] = dict.fromkeys(PRIORITIES, -float("inf"))  # last record taken
        self._fetching: set[Priority | None] = set()  # tiers with a partition assigned and not paused
        # Recent group members' run time, a moving average; until members have run, a guess that starts
        # groups of about 8 (pops a group gives back unstarted cost weighted order its precision).
        self._member_seconds = GROUP_WINDOW / 8
        self._quarantine: Task | None = None  # the suspect running alone, until its outcome is recorded
        self._suspect_waits = False  # a suspect is next: nothing starts until the running tasks end
        self._members_running = 0  # members of group commits started and not reported yet
        self._groups = any(s.transactional and s.group_commit for s in handlers)  # group commits may run
        self.heartbeat = metrics.Heartbeat()
        self._clock = clock
        self.broker: Broker = broker or KafkaBroker(self.settings)
        self._database = None
        beats: IdempotencyStore | None = None
        if store is None:
            self._database = Database(self.settings.database_url, schema=self.settings.database_schema)
            store = IdempotencyStore(
                self._database,
                owner=self.worker_id,
                namespace=self.settings.namespace,
                stale_after=self.config.stale_after,
            )
            # Outcomes and claims are sent on a connection and a thread of their own, so the loop goes on
            # fetching and dispatching while Postgres works on them; the heartbeat too.
            recorder, beats = (
                IdempotencyStore(
                    Database(self.settings.database_url, schema=self.settings.database_schema),
                    owner=self.worker_id,
                    namespace=self.settings.namespace,
                    stale_after=self.config.stale_after,
                )
                for _ in range(2)
            )
        self._beats = beats
        self.store: TaskStore = store
        self._recorder = recorder
        self._liveness = Liveness(
            beats or store,
            WorkerRecord(
                self.worker_id,
                self.settings.namespace,
                self.group,
                socket.gethostname(),
                os.getpid(),
                self.config.concurrency,
                datetime.now(UTC),
            ),
            lambda: len(self._running),
            interval=self.config.heartbeat_interval,
        )
        self._crashed = False  # the loop raised: keys may still be leased, so the liveness record stays
        self._pending_registry: PendingRegistry | None = None
        if registry is None:
            # Made on a thread of its own (importing and opening the HTTP client takes a few hundred ms),
            # which `start` then has look up the handlers' schemas: both while the worker joins its group.
            url, conf = self.settings.schema_registry_url, client_config(self.settings)
            registry = self._pending_registry = PendingRegistry(lambda: Registry(url, config=conf))
        self.executor = Executor(concurrency=self.config.concurrency, handlers_path=handlers.import_path)
        self._sink = self.broker.sink()
        self._completer = Completer(self.store, self._sink, recorder=recorder)
        self._limits = Limits(self.store, self.settings.namespace, clock=clock)
        self._intake = Intake(handlers, registry, self._limits, self.topics, clock=clock)
        self._outcome_stage = Outcomes(
            self._completer,
            self._offsets,
            self._limits,
            self._tracer,
            self.topics,
            delay_tiers=self.settings.delay_tiers,
            worker_id=self.worker_id,
            result_max_bytes=self.config.result_max_bytes,
            emit=self._emit,
            done=lambda task, dead: self._done(task, dead=dead),
            lift=self._lift_quarantine,
        )
        self._claims = Claims(
            self.store,
            self._completer,
            self._outcome_stage,
            self._offsets,
            claim_wait=self.config.claim_wait,
            default_lease=self.config.default_lease,
            emit=self._emit,
            clock=clock,
            done=self._done,
            ready=self._ready,
        )
        self._source: RecordSource | TierShares | None = None
        self._shares: TierShares | None = None  # the source, in share mode
        self._forwarder: tuple[Forwarder, threading.Thread] | None = None
        self._relay: tuple[OutboxRelay, threading.Thread] | None = None
        self._periodic: tuple[PeriodicScheduler, threading.Thread, TaskProducer] | None = None
        self._server: WSGIServer | None = None
        self._last_commit = 0.0
        self._services_checked_at = 0.0
        self._last_poll = 0.0
        self._last_lag = 0.0

    @property
    def registry(self) -> SchemaRegistry:
        """The schema registry that intake reads writer schemas from."""
        return self._intake.registry

    @registry.setter
    def registry(self, registry: SchemaRegistry) -> None:
        self._intake.registry = registry

    @property
    def _tracker(self) -> OffsetTracker:
        """The assigned partitions' offsets (in the offsets stage)."""
        return self._offsets.tracker

    @property
    def _assigned(self) -> set[TP]:
        """The partitions assigned (in the offsets stage)."""
        return self._offsets.assigned

    @property
    def _generation(self) -> dict[TP, int]:
        """Each partition's assignment (in the offsets stage)."""
        return self._offsets.generation

    @property
    def _held(self) -> list[Held]:
        """Tasks held out of the buffer to be claimed again (in the claims stage)."""
        return self._claims.held

    @property
    def _undecoded(self) -> list[Record]:
        """Records held for the registry (in intake): their offsets stay pending."""
        return self._intake.undecoded

    # ------------------------------------------------------------------------------------------- lifecycle
    def stop(self) -> None:
        """Ask the loop to shut down gracefully (what SIGTERM does)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: graceful shutdown; a second signal exits at once."""

        def handle(signum: int, frame: FrameType | None) -> None:
            if self._stop.is_set():
                log.warning("second signal: exiting now")
                import os

                os._exit(128 + signum)
            log.info(
                "signal %s: stopping (finishing in-flight tasks, up to %ss)",
                signum,
                self.config.shutdown_timeout,
            )
            self._stop.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def run(self) -> None:
        """Consume until stop() or a signal, then shut down gracefully."""
        self.start()
        try:
            while not self._stop.is_set():
                self._tick()
                if self._clock() >= self._services_checked_at + 1.0:
                    self._check_services()
                if self._pending_registry is not None and self._pending_registry.made():
                    # Made (or its settings refused, raised here: the worker stops with that one line even
                    # before a record needs the registry).
                    self._pending_registry = None
            self._shutdown()
        except BaseException:
            self._crashed = True
            raise
        finally:
            self.close()

    def _check_services(self) -> None:
        """Raise when a service this worker runs beside its loop (forwarder, relay, periodic scheduler)
        stopped on its own: the worker stops, with a non-zero exit, so that whatever supervises it starts it
        again, rather than run on without releasing delayed tasks or publishing the outbox."""
        self._services_checked_at = self._clock()
        threads = [
            ("delay forwarder", self._forwarder and self._forwarder[1]),
            ("outbox relay", self._relay and self._relay[1]),
            ("periodic scheduler", self._periodic and self._periodic[1]),
        ]
        for name, thread in threads:
            if isinstance(thread, ServiceThread) and not thread.is_alive():
                if isinstance(thread.error, KafkaAuthenticationError):
                    raise thread.error  # refused credentials: the one line (and exit code) they always get
                raise ServiceStoppedError(f"the {name} stopped (its error is logged above); the worker stops")

    def start(self) -> None:
        """Join the group and start the metrics server and the forwarder; `run` does it, tests may too."""
        if self.config.metrics_port is not None:  # first: a port in use fails before the group is joined
            self._server = metrics.serve(
                self.config.metrics_port,
                self.heartbeat.healthy,
                host=self.config.metrics_host,
                registry=self.metrics.registry,
            )
        # The group join next: its round trips to the broker go on, on librdkafka's threads, while Postgres
        # is checked here. Nothing is claimed before this returns (claims are the loop's), so the schema is
        # migrated and the host's dead predecessors are freed before the first claim, as before.
        if self.config.share_group:
            self._source = self._shares = self._offsets.shares = self._share_source()
        else:
            self._source = self.broker.source(
                group=self.group,
                on_assign=self._assigned_cb,
                on_revoke=self._revoked_cb,
                on_commit=self._committed_cb,
            )
        if self._pending_registry is not None:
            self._pending_registry.look_up_ahead([spec.task_type for spec in self.handlers])
        try:
            self._source.subscribe(self.topics.priority_topics)
            if self._database is not None:
                self._database.migrate(namespace=self.settings.namespace)
            self._liveness.start()
        except BaseException:
            # `run` closes nothing when `start` fails: leave the group and free the port now.
            self._source.close()
            self._source = None
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
            raise
        if self.config.forwarder:
            forwarder = Forwarder(
                self.settings,
                instance_id=self.worker_id,
                broker=self.broker,
                predecessors=self._liveness.predecessors,
            )
            self._forwarder = (forwarder, run_in_thread(forwarder, "forwarder"))
        if self.config.relay and self._database is not None:  # the outbox is in Postgres, not in the fakes
            relay = OutboxRelay(self.settings, broker=self.broker)
            self._relay = (relay, run_in_thread(relay, "relay"))
        if self.config.periodic and self._database is not None and self.handlers.periodic_tasks:
            self._periodic = self._start_periodic(self._database)
        self._emit(WorkerStarted(self.worker_id, self.group))

    def _share_source(self) -> TierShares:
        """The tiers' share groups' member (share mode), once the handlers are known to work there."""
        ordered = sorted(spec.task_type for spec in self.handlers if spec.ordered)
        if ordered:
            raise ConfigurationError(
                "ordered task types need partition order, which share groups do not keep: "
                f"{', '.join(ordered)} (run them on workers without --share-group)"
            )
        if not isinstance(self.broker, KafkaBroker):
            raise ConfigurationError("share groups need a Kafka broker (the in-memory one has none)")
        return TierShares(
            self.broker,
            consumers=max(2, self.config.concurrency),
            max_poll_records=self.config.concurrency,
            on_assign=self._assigned_cb,
            lock_duration_ms=self.config.share_lock_ms,
        )

    def _start_periodic(
        self, database: Database
    ) -> tuple[PeriodicScheduler, threading.Thread, TaskProducer]:
        # Slots are staged in the outbox, in the transaction that advances the schedule: the relay publishes.
        producer = TaskProducer(self.settings, registry=self.registry, broker=self.broker)

        def stage(spec: PeriodicSpec, slot: datetime, conn: Any) -> None:
            producer.enqueue(
                spec.task_type,
                spec.payload,
                priority=spec.priority,
                idempotency_key=spec.idempotency_key(slot),
                conn=conn,
            )

        scheduler = PeriodicScheduler(
            self.handlers.periodic_tasks,
            Database(self.settings.database_url, schema=self.settings.database_schema),
            self.settings.namespace,
            stage,
        )
        return scheduler, run_in_thread(scheduler, "periodic"), producer

    def step(self) -> None:
        """One turn of the loop: fetch, dispatch, record outcomes, commit when due."""
        self._tick()

    def idle(self) -> bool:
        """Nothing buffered, held, running, or waiting to be recorded, acked, committed or given back."""
        return not (
            self._running
            or self._claims.held
            or self._limits.pending()
            or self._on_hold
            or self._undecoded
            or self._completer.pending()
            or len(self._scheduler)
            or self._offsets.pending()
        )

    def waiting_until(self) -> float | None:
        """When the worker has nothing to do but wait for held tasks, or for the slots and tokens of its
        limited tasks' keys: the clock time the first may go on."""
        if self._running or self._undecoded or self._completer.pending():
            return None
        dues = [h.due for h in self._claims.held]
        if len(self._scheduler):
            if any(t.gate is None or self._limits.ready(t.gate) for t in self._scheduler):
                return None
            dues += [self._limits.ready_at(t.gate) for t in self._scheduler if t.gate is not None]
        return min(dues) if dues else None

    def close(self) -> None:
        """Leave the group and release every client (after `start`)."""
        if self._forwarder is not None:
            forwarder, thread = self._forwarder
            forwarder.stop()
            thread.join(timeout=15)
            self._forwarder = None
        if self._periodic is not None:
            scheduler, thread, producer = self._periodic
            scheduler.stop()
            thread.join(timeout=15)
            producer.close(5)
            self._periodic = None
        if self._relay is not None:
            relay, thread = self._relay
            relay.stop()
            thread.join(timeout=15)
            self._relay = None
        if self._source is not None:
            log.info("stopping: leaving the group")
            source, self._source = self._source, None
            try:
                source.close()
            except TaskqError as exc:  # refused or away: what finished is committed; the rest is released
                log.warning("leaving the group: %s", exc)
        self.executor.shutdown(timeout=1.0)
        self._completer.close()
        # A clean stop completed, failed or released every key: the record goes. After a crash it stays,
        # goes stale, and the keys still leased are taken over then.
        self._liveness.stop(clean=not self._crashed)
        if self._recorder is not None:
            self._recorder.close()
        if self._beats is not None:
            self._beats.close()
        self.store.close()
        self.registry.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._emit(WorkerStopped(self.worker_id))

    def _emit(self, event: Event) -> None:
        for hook in self._hooks:
            hook(event)

    # ------------------------------------------------------------------------------------------------ loop
    def _tick(self) -> None:
        self.heartbeat.beat()
        assert self._source is not None
        waiting = len(self._scheduler) + len(self._claims.held) + len(self._on_hold) + len(self._undecoded)
        waiting += self._completer.claiming()
        busy = bool(self._running or waiting or self._completer.pending())
        room = max(1, min(500, self.config.buffer_capacity - waiting))
        if self._shares is not None:
            # Share mode takes only what can start now: a record buffered here is locked from the other
            # members, and one acquired beyond that (a whole producer batch comes at once) is let go soon.
            room = max(0, min(room, self.executor.free_slots() - waiting))
            if not room:
                self._shares.shed(SHED_AFTER)
        now = self._clock()
        records: list[Record] = []
        waited = False
        # Fetch in batches of at least a quarter of the buffer, so claims go to Postgres hundreds at a time,
        # not a slot's worth; and at least every 50 ms, which serves rebalance callbacks and keeps the group
        # membership alive even when the buffer is full.
        due = now - self._last_poll >= 0.05
        if room >= self.config.buffer_capacity // 4 or not busy or due or self._short():
            self._last_poll = now
            # consume(n, timeout) waits for all n records or the timeout: take what is there, and block only
            # for one record (then the rest that came with it), never on a timeout. Block while idle, and
            # while slots are free with nothing buffered for them: what starts next is a record on its way,
            # and consume() returns the moment it arrives (running tasks' outcomes wait for it, at most 5 ms).
            records = self._take(room)
            if not records and (not busy or self._starved()):
                records = self._source.poll(1, 0.005 if busy else 0.25)
                waited = True
                if records and room > 1:
                    records += self._take(room - 1, records)
        self._take_in(self._intake.retry_ready(), tracked=True)
        self._arrived_from(records)
        self._take_in(records)
        self._claim_arrived()
        self._read_pauses()
        self._flow_control()
        self._claims.release_due()
        self._completer.settle()  # what earlier claims answered goes into the buffers first
        if self._settled():
            self._dispatch()
        self._collect(block=0.0)
        self._limits.flush()
        self._completer.flush(linger=0.005)
        self._completer.serve()
        if self._clock() - self._last_commit >= self.config.commit_interval:
            self._commit(asynchronous=True)
        self._observe()
        if busy and not records and not waited:
            if self._completer.claiming() and self._idle_slots():
                # Free slots wait for what is being claimed: wake the moment Postgres answers.
                self._completer.settle(0.005)
            else:
                # Nothing new from Kafka: sleep until a running task reports (wakes at once), not a tick.
                self._collect(block=0.005 if self.executor.free_slots() else 0.05)

    def _take(self, room: int, taken: Sequence[Record] = ()) -> list[Record]:
        """Up to `room` records that Kafka has fetched already, without waiting.

        librdkafka hands out fetched records in the order they came, tier after tier, so one large take
        could fill the buffer with the first tiers fetched and leave none for the others. Records are taken
        in chunks no larger than what can be taken before some tier is saturated (POLL_CHUNK at least), and
        saturated tiers are paused between chunks: pausing drops their fetched records, and the next chunk
        comes from the tiers still short of their reserve (invariant 4).
        """
        assert self._source is not None
        incoming = self._claims.claiming.copy()
        for record in taken:
            tier = self.topics.priority_of(record.topic)
            if tier is not None:
                incoming[tier] += 1
        records: list[Record] = []
        while room > 0:
            chunk = min(room, max(POLL_CHUNK, self._scheduler.headroom(incoming)))
            got = self._source.poll(chunk, 0.0)
            records += got
            room -= len(got)
            if len(got) < chunk:
                break  # nothing more fetched for now
            for record in got:
                tier = self.topics.priority_of(record.topic)
                if tier is not None:
                    incoming[tier] += 1
            self._flow_control(incoming)
        return records

    def _settled(self) -> bool:
        """Before the first dispatch: whether partitions of every tier are assigned (or SETTLE passed since
        the first assignment), and every assigned partition with records to read has delivered one (or
        waited SETTLE seconds for it).

        Until then nothing starts: a worker that starts on a backlog would otherwise run the first tier
        fetched (librdkafka may even assign a group's partitions topic by topic) alone, before the others'
        records arrive a few milliseconds later (invariant 4).
        """
        if self._first_assigned is None:
            return True  # nothing assigned, nothing to start
        assert self._source is not None
        now = self._clock()
        if not self._dispatched:
            tiers = {self.topics.priority_of(t) for t, _ in self._offsets.assigned} - {None}
            if len(tiers) < len(PRIORITIES) and now - self._first_assigned < SETTLE:
                return False
        if self._settling:
            # Nor for a partition that flow control paused: its tier's share is buffered already, and it
            # delivers nothing while paused (librdkafka fills a tier from its first partitions).
            waiting = [
                tp
                for tp, at in self._settling.items()
                if now - at < SETTLE and tp in self._offsets.assigned and tp not in self._paused
            ]
            # Nothing to wait for in an empty partition. (Where the group's reading starts is not asked for:
            # a committed-offsets request made from the loop can block it while a rebalance is in flight,
            # and a partition read to its end costs at most SETTLE, once.)
            ends = self._source.high_watermarks(waiting) if waiting else {}
            self._settling = {tp: self._settling[tp] for tp, end in ends.items() if end != 0}
        self._dispatched = not self._settling
        return self._dispatched

    def _arrived_from(self, records: Sequence[Record]) -> None:
        """Tiers that delivered records were fed now; partitions that delivered a record are settled."""
        now = self._clock()
        for topic in {r.topic for r in records}:
            tier = self.topics.priority_of(topic)
            if tier is not None:
                self._fed[tier] = now
        if self._settling:
            for record in records:
                self._settling.pop(record.tp, None)

    def _short(self) -> bool:
        """A tier being fetched holds under half its reserve: take what Kafka has for it now, not in 50 ms,
        or a heavy tier runs dry while its records wait and the lighter ones take its turns (invariant 4)."""
        recent = self._clock() - 1.0
        return any(
            self._fed[tier] > recent
            and self._scheduler.depth(tier) + self._claims.claiming[tier] < self._scheduler.reserve(tier) // 2
            and tier in self._fetching
            for tier in PRIORITIES
        )

    def _starved(self) -> bool:
        """Slots are free and nothing buffered is waiting for one, nor being claimed for one."""
        return not self._completer.claiming() and self._idle_slots()

    def _idle_slots(self) -> bool:
        """Slots are free and nothing buffered is waiting for one."""
        waiting = len(self._scheduler) or self._claims.held or self._undecoded
        return not waiting and self.executor.free_slots() > 0

    def _accept(self, record: Record, *, tracked: bool = False) -> None:
        """Take in one fetched record (the loop takes in each poll's records as one batch)."""
        self._take_in([record], tracked=tracked)

    def _take_in(self, records: Sequence[Record], *, tracked: bool = False) -> None:
        """Track a batch of fetched records' offsets and decode it (intake); input that can never run goes
        to the DLQ, and the tasks wait in `_arrived` to be claimed in one round trip."""
        if not records:
            return
        self._intake.weigh(records)
        admitted, again = self._offsets.admit(records, tracked=tracked)
        if again:
            self._outcome_stage.send_again(again)
        tasks, rejected = self._intake.decode(admitted, self._offsets.generation)
        if rejected:
            self._outcome_stage.reject(rejected, self._offsets.generation)
        self._arrived += tasks

    def _claim_arrived(self) -> None:
        """Claim the keys of the tasks decoded this tick, all in one round trip."""
        if self._arrived:
            arrived, self._arrived = self._arrived, []
            self._claims.claim(arrived)

    def _ready(self, tasks: list[Task]) -> None:
        """Claimed tasks go into the buffers, for dispatch in weighted order."""
        push = self._scheduler.push
        for task in tasks:
            push(task.tier, task)

    def _flow_control(self, incoming: Mapping[Priority, int] | None = None) -> None:
        """Pause the partitions of saturated tiers, resume the others (bounded memory, no starvation).

        `incoming`: records per tier taken from Kafka this tick and not yet buffered, counted as buffered.
        """
        assert self._source is not None
        if incoming is None:
            incoming = self._claims.claiming
        to_pause, to_resume = [], []
        # Copies held back while their key is leased take no slot and leave the scheduler, yet they are
        # buffered tasks: with the buffers full, a tier holding its reserve's worth is paused as saturated.
        waiting = len(self._scheduler) + len(self._claims.held) + len(self._on_hold)
        full = waiting + (sum(incoming.values()) if incoming else 0) >= self.config.buffer_capacity
        held = Counter(self.topics.priority_of(h.task.record.topic) for h in self._claims.held if full)
        held.update(t.tier for t in self._on_hold if full)
        # Over the byte bound every partition waits: what is buffered runs first, then fetching resumes.
        heavy = self._over_bytes() or self._stop.is_set()
        # Decided per tier, then applied to its partitions: the rule reads every tier's depth, and a worker
        # holds tens of partitions.
        depths: dict[Priority, int] = {}
        halt: dict[Priority, bool] = {}
        for tier in PRIORITIES:
            depth = depths[tier] = self._scheduler.depth(tier) + (incoming or {}).get(tier, 0)
            over = full and held[tier] + depth >= self._scheduler.reserve(tier)
            paused = tier in self._pauses.tiers  # by an operator: nothing more is fetched
            halt[tier] = heavy or over or paused or self._scheduler.saturated(tier, incoming)
        for tp in self._offsets.assigned:
            of = self.topics.priority_of(tp[0])
            if of is None:
                continue
            depth = depths[of]
            if halt[of]:
                if tp not in self._paused:
                    to_pause.append(tp)
                    self._resume_at[of] = depth * 3 // 4
            elif tp in self._fresh or (tp in self._paused and depth <= self._resume_at[of]):
                # Hysteresis: a paused tier resumes once a quarter of what it held has run, early enough
                # for the refetch to arrive before it runs dry. Pausing drops the partition's prefetched
                # records, so resuming at the first free place made every poll a pause and a refetch; at
                # half, one dispatch of group commits (a wave of 8 groups: about critical's whole half) left
                # critical or high empty until the refetch came, in 3 of 24 runs of the weights test on a
                # quiet machine (0 of 24 at three quarters).
                to_resume.append(tp)
        self._source.pause(to_pause)
        self._source.resume(to_resume)
        self._paused |= set(to_pause)
        self._paused -= set(to_resume)
        fetching = self._offsets.assigned - self._paused
        self._fetching = {self.topics.priority_of(tp[0]) for tp in fetching} - {None}
        self._fresh.clear()

    def _over_bytes(self) -> bool:
        """Whether the buffered records (waiting, held, undecoded) take more than `buffer_bytes`."""
        waiting = len(self._scheduler) + len(self._claims.held) + len(self._on_hold) + len(self._undecoded)
        if waiting * self._intake.largest < self.config.buffer_bytes:
            return False  # cannot be over whatever their sizes: no need to add them up (the usual case)
        total = sum(size(t.record) for t in self._scheduler) + sum(size(t.record) for t in self._on_hold)
        total += sum(size(h.task.record) for h in self._claims.held) + sum(size(r) for r in self._undecoded)
        return total >= self.config.buffer_bytes

    def _read_pauses(self) -> None:
        """Every `pause_interval` seconds: read what operators paused, give resumed tasks back to the
        scheduler, and renew the leases of paused tasks that wait long, so no other worker takes them over."""
        now = self._clock()
        if now - self._pauses_read_at < self.config.pause_interval:
            return
        self._pauses_read_at = now
        self._read_cancels()
        try:
            pauses = self.store.pauses()
        except StoreUnavailableError as exc:  # the last known state holds meanwhile
            log.warning("cannot read pauses: %s", exc)
            return
        if pauses != self._pauses:
            log.info(
                "paused tiers: %s; paused task types: %s",
                ", ".join(sorted(pauses.tiers)) or "none",
                ", ".join(sorted(pauses.task_types)) or "none",
            )
            self._pauses = pauses
        resumed = [t for t in self._on_hold if t.envelope.task_type not in pauses.task_types]
        if resumed:
            self._on_hold = [t for t in self._on_hold if t.envelope.task_type in pauses.task_types]
            for task in reversed(resumed):  # first in line again, in their order
                self._scheduler.push_front(task.tier, task)
        stale = now - self.config.claim_wait / 2
        waiting = [t for t in self._on_hold if t.claimed_at < stale]
        waiting += [t for t in self._scheduler if t.tier in pauses.tiers and t.claimed_at < stale]
        if not waiting:
            return
        # A paused task keeps its claim: its lease is renewed while it waits, and no attempt is counted.
        try:
            renewed = self.store.renew(
                [(t.envelope.idempotency_key, t.attempts, self._claims.lease(t) + self.config.claim_wait)
                 for t in waiting]
            )
        except StoreUnavailableError as exc:
            log.warning("could not renew the leases of %d paused task(s): %s", len(waiting), exc)
            return
        lost = {id(t) for t in waiting if t.envelope.idempotency_key not in renewed}
        for task in waiting:
            if id(task) in lost:
                # Taken over while paused: the worker holding the lease now decides this key.
                log.warning("task %s: lease taken over while paused", task.envelope.task_id)
                self._done(task)
            else:
                task.claimed_at = now
        if lost:
            self._on_hold = [t for t in self._on_hold if id(t) not in lost]
            self._scheduler.remove_if(lambda t: id(t) in lost)

    def _read_cancels(self) -> None:
        """With the pauses: which tasks that run here or wait claimed in the buffer were cancelled. A running
        one's handler sees ctx.cancelled; a waiting one never starts: its attempt is recorded failed, which
        a cancelled key's record turns into cancelled (no retry, no DLQ), and its offset moves on."""
        running = [t for t in self._running.values() if t.ctx is not None and not t.ctx.cancelled]
        waiting = [*self._scheduler, *self._on_hold]
        if not running and not waiting:
            return
        try:
            asked = self.store.cancel_requested(
                [t.envelope.idempotency_key for t in (*running, *waiting)]
            )
        except StoreUnavailableError as exc:
            log.warning("cannot read cancellations: %s", exc)
            return
        if not asked:
            return
        for task in running:
            if task.envelope.idempotency_key in asked and task.ctx is not None:
                task.ctx.cancelled = True
        dropped = {id(t): t for t in waiting if t.envelope.idempotency_key in asked}
        if not dropped:
            return
        self._scheduler.remove_if(lambda t: id(t) in dropped)
        self._on_hold = [t for t in self._on_hold if id(t) not in dropped]
        for task in dropped.values():
            env = task.envelope
            self._emit(CancelledSkipped(env.task_type, env.task_id, env.idempotency_key))
            self._completer.record(
                Finished(
                    env.idempotency_key,
                    task.attempts,
                    "failed",
                    error="cancelled before it started",
                    workflow=task.workflow,
                ),
                lambda task=task: self._done(task),  # type: ignore[misc]
            )

    def _dispatch(self) -> None:
        """Start claimed tasks in weighted order, one slot each; transactional tasks ready together share
        a slot and a transaction (group commit), in as few groups as GROUP_MAX allows. A suspect (a key
        taken over from a dead worker) runs alone, outside any group (invariant 10)."""
        if self._quarantine is not None:
            return  # a suspect runs: nothing starts beside it until its outcome is recorded
        free = self.executor.free_slots()
        if not free or not len(self._scheduler) or (self._suspect_waits and self._running):
            return  # (a suspect waits for the tasks running to end)
        self._suspect_waits = False
        wave = len(self._scheduler) // 2
        if self._groups and not self._members_running and self._short_of_wave(wave, free):
            # A wave of group commits is due (below). It takes up to half the buffer at once, in weighted
            # order: a tier whose refetched records are still being claimed would miss its turns in it,
            # and the tiers buffered would take them (invariant 4). Postgres answers in milliseconds.
            self._completer.wait_claimed(WAVE_WAIT)
        # At most half of what is buffered goes into the groups of one dispatch: the rest, and what is
        # fetched meanwhile, keeps the weighted order deciding what runs next. That half goes into as few
        # groups as the members' pace allows, not one per free slot: a group's transaction, completion
        # statement and commit are shared by more attempts.
        half = len(self._scheduler) // 2
        size = self._group_fits()
        groups = min(free, -(-half // size)) if half > free else free
        per_group = min(size, -(-half // groups)) if half > free else 1
        # Groups start in waves, never beside the groups of an earlier dispatch: groups run side by side
        # member by member, and the members of one wave are dealt out in turn (below), so effects land in
        # the order of the picks. Groups started one by one as others end would each run a stretch of
        # picks at once, and a tier's share over a window would depend on which stretches it cut.
        most = groups * per_group if not self._members_running else 0  # members of this dispatch's groups
        singles: list[Task] = []
        members: list[Task] = []
        # Ordered tasks whose key is held by an earlier task, and limited tasks whose key has no slot or
        # token now: they keep their place in the buffer, and the tasks behind them go by.
        waiting: list[Task] = []
        popped: dict[int, int] = {}  # pop order, to put the waiting tasks back in place
        while True:
            used = len(singles) + -(-len(members) // per_group)
            open_group = len(members) % per_group != 0 and len(members) < most
            if used >= free and not open_group:
                break
            task = self._scheduler.pop(skip=self._pauses.tiers)
            if task is None:
                break
            if task.envelope.task_type in self._pauses.task_types:
                self._on_hold.append(task)  # claimed, and held until its type is resumed
                continue
            popped[id(task)] = len(popped)
            if task.spec.ordered and self._key_holder.get(_key(task), id(task)) != id(task):
                waiting.append(task)
                continue
            if task.gate is not None and not self._limits.ready(task.gate):
                waiting.append(task)
                continue
            if task.suspect:
                # Quarantine: blamed for its worker's death only if it ran alone, a suspect starts only
                # when nothing else runs, and nothing else starts until its outcome is recorded.
                if singles or members or self._running:
                    self._scheduler.push_front(task.tier, task)  # next in line (its pick is refunded)
                    self._suspect_waits = True
                else:
                    singles.append(task)
                    self._hold_key(task)
                break
            # A workflow's step commits alone: the transaction recording its end also moves the workflow on.
            if not (task.spec.transactional and task.spec.group_commit) or task.workflow is not None:
                if used >= free:  # only the open group had room: the task waits, first in line
                    self._scheduler.push_front(task.tier, task)
                    break
                singles.append(task)
                self._hold_key(task)
                continue
            if len(members) >= most or (not open_group and used >= free):
                self._scheduler.push_front(task.tier, task)
                break
            members.append(task)
            self._hold_key(task)
        # Members are dealt to the groups in turn, not in runs: groups run side by side, member by member,
        # so effects land in the order of the picks, and weighted order holds over any window of them.
        n = -(-len(members) // per_group)
        jobs: list[list[Task]] = [[t] for t in singles] + [members[i::n] for i in range(n)]
        gated = [t for job in jobs for t in job if t.gate is not None]
        if gated:
            # One round trip for the batch's slots, one per bucket whose leased tokens ran out: a task
            # refused waits, claimed, and has used up no attempt.
            admitted = self._limits.admit(
                [(t.envelope.idempotency_key, t.gate, self._claims.lease(t)) for t in gated if t.gate]
            )
            refused = {id(t) for t in gated if t.envelope.idempotency_key not in admitted}
            if refused:
                for job in jobs:
                    for t in job:
                        if id(t) in refused:
                            self._free_key(t)
                            waiting.append(t)
                jobs = [[t for t in job if id(t) not in refused] for job in jobs]
        stale = self._clock() - self.config.claim_wait / 2
        waited = [t for job in jobs for t in job if t.claimed_at < stale]
        # Limited tasks waiting for their key keep their claims: renewed as they age, as the others at start.
        parked = [t for t in waiting if t.gate is not None and t.claimed_at < stale]
        lost: set[int] = set()
        if waited or parked:
            # One statement renews every long-waiting task of this dispatch; those not renewed are dropped.
            lost = {id(t) for t in waited + parked} - {id(t) for t in self._claims.renew(waited, parked)}
        suspects = [t for job in jobs for t in job if t.suspect and id(t) not in lost]
        if suspects:
            # Keys taken over before may be poison pills: their runs are marked started before they start, so
            # that this worker's death counts as an interruption. One statement for the dispatch, and only
            # after a worker died: the run of a plain key writes nothing before it starts.
            lost |= {id(t) for t in suspects} - {id(t) for t in self._claims.mark_started(suspects)}
        if lost:
            for job in jobs:
                for t in job:
                    if id(t) in lost:
                        self._free_key(t)
                        self._limits.release(t.envelope.idempotency_key)
            jobs = [[t for t in job if id(t) not in lost] for job in jobs]
            waiting = [t for t in waiting if id(t) not in lost]
        waiting.sort(key=lambda t: popped[id(t)])
        for task in reversed(waiting):
            self._scheduler.push_front(task.tier, task)
        for job in jobs:
            if job and job[0].suspect:
                self._quarantine = job[0]
                self._start(job[0])
            elif job and job[0].spec.transactional and job[0].spec.group_commit and not job[0].workflow:
                self._start_group(job)
            elif job:
                self._start(job[0])

    def _short_of_wave(self, wave: int, free: int) -> bool:
        """A wave of `wave` picks is due, and a tier whose records are being claimed holds less than its
        weighted share of it."""
        if wave <= free or not self._completer.claiming():
            return False
        capacity, claiming = self.config.buffer_capacity, self._claims.claiming
        return any(
            claiming[t] and self._scheduler.depth(t) * capacity < wave * self._scheduler.reserve(t)
            for t in PRIORITIES
        )

    def _group_fits(self) -> int:
        """Members a group starts within GROUP_WINDOW, at the recent members' pace: a group popped larger
        gives the rest back unstarted, and weighted order is kept best by pops that start."""
        return max(1, min(GROUP_MAX, int(GROUP_WINDOW / max(self._member_seconds, 1e-6)) + 1))

    def _start(self, task: Task) -> None:
        env = task.envelope
        ctx = self._context(task)
        call = None
        if task.spec.transactional:
            spec, store, limit = task.spec, self.store, self.config.result_max_bytes
            workflow = task.workflow

            def call() -> Any:
                returned: list[Any] = [None]
                with store.transaction(
                    env.idempotency_key, task.attempts, result_of=lambda: returned[0], workflow=workflow
                ) as conn:
                    ctx.db = conn
                    # Checked inside the transaction: a result that cannot be stored rolls the effect back.
                    returned[0] = checked_result(spec.fn(task.payload, ctx), limit)
                task.recorded = True
                return returned[0]

        timeout = task.spec.timeout or env.timeout
        task.ctx = ctx
        self._running[id(task)] = task
        self._emit(
            AttemptStarted(env.task_type, env.task_id, env.idempotency_key, task.attempts, task.suspect)
        )
        trace = None
        if self._tracer.active():
            task.span, trace = self._attempt_span(task)
        self.executor.submit(
            Job(spec=task.spec, payload=task.payload, ctx=ctx, timeout=timeout, call=call, trace=trace),
            lambda outcome: self._outcomes.put((task, outcome)),
        )

    def _attempt_span(self, task: Task) -> tuple[Any, contextvars.Context]:
        record = task.record
        return self._tracer.attempt(
            task.envelope, record.topic, task.attempts, self.group, record.partition, record.offset
        )

    def _context(self, task: Task) -> TaskContext:
        env = task.envelope
        workflow = task.workflow
        return TaskContext(
            task_id=env.task_id,
            task_type=env.task_type,
            attempt=task.attempts,
            max_attempts=env.max_attempts or task.spec.policy.max_attempts,
            idempotency_key=env.idempotency_key,
            priority=env.priority,
            headers=dict(task.record.headers),
            logger=_task_logger(env.task_type),
            workflow_inputs=None
            if workflow is None
            else functools.partial(self.store.workflow_inputs, workflow),
        )

    def _start_group(self, tasks: list[Task]) -> None:
        """Run transactional tasks one after another in one transaction on one slot (group commit)."""
        contexts = [self._context(t) for t in tasks]

        def member(task: Task, ctx: TaskContext) -> Member:
            timeout = task.spec.timeout or task.envelope.timeout

            def call(conn: Any) -> Any:
                ctx.db = conn
                ctx.deadline = time.monotonic() + timeout if timeout else None
                if self._tracer.active():
                    task.span, trace = self._attempt_span(task)
                    returned = trace.run(task.spec.fn, task.payload, ctx)
                else:
                    returned = task.spec.fn(task.payload, ctx)
                # Checked under the member's savepoint: a result that cannot be stored rolls it back alone.
                return checked_result(returned, self.config.result_max_bytes)

            tp = task.record.tp
            # A member whose turn comes after SIGTERM or its partition's revocation is not started: the
            # group commits what ran, and shutdown and revoke wait for one attempt, not a whole group.
            # Nor one whose turn comes after the group's window: it goes back to the buffer, still
            # claimed, and a group's effects are never held back for long.
            return Member(
                task.envelope.idempotency_key,
                task.attempts,
                call,
                skip=lambda: self._stop.is_set() or tp in self._revoking or window_passed(),
            )

        began: list[float] = []

        def window_passed() -> bool:
            if not began:
                began.append(time.monotonic())
            return time.monotonic() - began[0] > GROUP_WINDOW

        members = [member(t, c) for t, c in zip(tasks, contexts, strict=True)]
        store = self.store

        def run() -> list[Member]:
            store.run_group(members)
            return members

        def report(outcome: Outcome) -> None:
            # One outcome per task: its own when the group committed; the group's when it did not (a
            # failed commit records nothing, so every task of the group runs again).
            for task, m in zip(tasks, members, strict=True):
                if isinstance(m.error, NotStarted):
                    self._outcomes.put((task, failure(m.error, 0.0)))
                elif not outcome.ok:
                    error = outcome.error
                    lost = isinstance(error, LeaseLostError) and m.idempotency_key in error.keys
                    if isinstance(error, LeaseLostError) and not lost:
                        error = GroupRolledBack(f"rolled back with its group: {error}")
                        self._outcomes.put((task, failure(error, m.seconds)))
                    else:
                        self._outcomes.put((task, outcome))
                elif m.error is not None:
                    self._outcomes.put((task, failure(m.error, m.seconds)))
                else:
                    task.recorded = True
                    self._outcomes.put((task, Outcome(ok=True, result=m.result, seconds=m.seconds)))

        timeouts = [t.spec.timeout or t.envelope.timeout for t in tasks]
        for task, ctx in zip(tasks, contexts, strict=True):
            task.ctx = ctx
            self._running[id(task)] = task
            task.grouped = True  # AttemptStarted is emitted when it reports: a member may never start
        self._members_running += len(tasks)
        self.executor.submit(
            Job(
                spec=tasks[0].spec,
                payload=None,
                ctx=contexts[0],
                timeout=None if None in timeouts else sum(t or 0.0 for t in timeouts),
                call=run,
            ),
            report,
        )

    def _collect(self, block: float) -> None:
        """Take the outcomes reported so far (waiting up to `block` for the first) as one batch, and hand it
        to the outcomes stage; group members past their group's window go back to the buffer instead."""
        try:
            first = self._outcomes.get(timeout=block) if block > 0 else self._outcomes.get_nowait()
        except queue.Empty:
            return
        reported = [first]
        while True:
            try:
                reported.append(self._outcomes.get_nowait())
            except queue.Empty:
                break
        ended: list[tuple[Task, Outcome]] = []
        for task, outcome in reported:
            self._running.pop(id(task), None)
            if task.gate is not None:
                self._limits.release(task.envelope.idempotency_key)  # the attempt ended (or never started)
            if task.grouped:
                self._members_running -= 1
                if isinstance(outcome.error, NotStarted):
                    task.grouped = False
                    tp = task.record.tp
                    current = self._offsets.current(tp, task.generation)
                    if current and not self._stop.is_set() and tp not in self._revoking:
                        self._scheduler.push_front(task.tier, task)  # past its group's window: still claimed
                    else:
                        self._unstarted.append(task)  # its claim is given back; its offset stays uncommitted
                    continue
                self._member_seconds += (outcome.seconds - self._member_seconds) / 8
            ended.append((task, outcome))
        again = self._outcome_stage.settle(ended, self._clock())
        self._claims.held.extend(Held(task, due) for task, due in again)
        if self._unstarted:
            unstarted, self._unstarted = self._unstarted, []
            self._claims.release(unstarted)

    def _done(self, task: Task, *, dead: bool = False) -> None:
        self._free_key(task)
        self._lift_quarantine(task)
        self._offsets.done(task.record, task.generation, dead=dead)

    def _lift_quarantine(self, task: Task) -> None:
        """The suspect running alone has its outcome recorded: other tasks may start again. (Until then,
        its run is still marked started, and a death would be charged to it.)"""
        if self._quarantine is task:
            self._quarantine = None

    def _hold_key(self, task: Task) -> None:
        if task.spec.ordered:
            self._key_holder[_key(task)] = id(task)

    def _free_key(self, task: Task) -> None:
        if task.spec.ordered and self._key_holder.get(_key(task)) == id(task):
            del self._key_holder[_key(task)]

    def _commit(self, tps: set[TP] | None = None, *, asynchronous: bool = False) -> bool:
        """Commit what is committable (of `tps`, if given); False if the commit failed (`Offsets.commit`)."""
        assert self._source is not None
        self._last_commit = self._clock()
        return self._offsets.commit(self._source, tps, asynchronous=asynchronous)

    def _committed_cb(self, offsets: dict[TP, int], error: str | None) -> None:
        """An asynchronous commit's outcome (`Offsets.committed`)."""
        self._offsets.committed(offsets, error)

    def _serve_group(self) -> None:
        """Poll while stopping: serves rebalance callbacks. Records fetched meanwhile (of partitions assigned
        during shutdown) are left untracked and uncommitted: their next owner reads them again."""
        assert self._source is not None
        self._source.poll(500, 0.0)

    def _observe(self) -> None:
        lag: dict[Priority, int] | None = None
        now = self._clock()
        if self._source is not None and now - self._last_lag >= 5.0:
            self._last_lag = now
            lag = dict.fromkeys(PRIORITIES, 0)
            for tp, n in self._source.lag().items():
                tier = self.topics.priority_of(tp[0])
                if tier is not None:
                    lag[tier] += n
        buffered = {p: self._scheduler.depth(p) for p in PRIORITIES}
        held = self._shares.in_flight() if self._shares is not None else None
        self._emit(
            LoopSampled(
                len(self._running), self.executor.running(), self.config.concurrency, buffered, lag, held
            )
        )

    # ---------------------------------------------------------------------------------------- rebalances
    def _assigned_cb(self, tps: list[TP]) -> None:
        """Start newly assigned partitions from a clean slate; partitions kept through the rebalance are
        not in `tps` (incremental assignment) and keep their buffered, held and running work."""
        self._offsets.assign(tps)  # the partition is read again from its committed offset
        self._paused.difference_update(tps)
        # librdkafka keeps a partition's pause across revoke and re-assign: one paused before it was revoked
        # (or lost) comes back paused. Flow control resumes fresh partitions explicitly, or they would stall.
        self._fresh |= set(tps)
        now = self._clock()
        if not self._dispatched:
            # Only a starting worker waits for its partitions' first records: a running one has work
            # buffered, and a partition it gains may stay paused (its tier full) and never deliver.
            self._settling.update(dict.fromkeys(tps, now))
        if self._first_assigned is None:
            self._first_assigned = now
        log.info("assigned %s", ", ".join(f"{t}[{p}]" for t, p in tps))
        self._emit(PartitionsAssigned(list(tps)))

    def _revoked_cb(self, tps: list[TP]) -> None:
        """Finish in-flight tasks of revoked partitions within a bound, commit, and drop their buffers."""
        # Only the revoked partitions' work is dropped: retained partitions keep their buffered, held,
        # undecoded and running tasks, their pending offsets and their pause state (invariant 8).
        revoked = set(tps)
        self._revoking = revoked
        # Claims on their way land in the buffers first, so the claimed keys of revoked partitions are
        # given back with the rest (one answered later is given back by `_claimed`).
        self._completer.wait_claimed(5.0)
        dropped = self._scheduler.remove_if(lambda t: t.record.tp in revoked)
        dropped += [t for t in self._on_hold if t.record.tp in revoked]
        self._on_hold = [t for t in self._on_hold if t.record.tp not in revoked]
        # Claimed ahead and never started: the partition's new owner claims them at once, same attempt.
        self._claims.release(dropped)
        self._claims.forget(revoked)
        self._intake.forget(revoked)
        self._key_holder = {k: v for k, v in self._key_holder.items() if k[0] not in revoked}
        self._drain(
            lambda: any(t.record.tp in revoked for t in self._running.values()),
            timeout=self.config.revoke_timeout,
            ack_timeout=5.0,
        )
        try:
            self._commit(revoked)
        except Exception as exc:  # a lost partition cannot be committed; its new owner redoes the rest
            log.warning("commit on revoke failed: %s", exc)
        self._offsets.revoke(revoked)
        self._paused -= revoked
        self._revoking = set()
        log.info(
            "revoked %s (%d buffered task(s) dropped)", ", ".join(f"{t}[{p}]" for t, p in tps), len(dropped)
        )
        self._emit(PartitionsRevoked(list(tps), len(dropped)))

    def _drain(
        self, running: Callable[[], bool], *, timeout: float, ack_timeout: float, serve_group: bool = False
    ) -> None:
        """Let running tasks report while `running()` holds (up to `timeout`), record their outcomes and
        wait for the broker to acknowledge every retry and DLQ record: what revoke and shutdown share.

        `serve_group`: keep polling the consumer meanwhile (never from inside a rebalance callback), so a
        rebalance that starts during shutdown is answered: a member that stops polling is fenced after the
        rebalance timeout, and its final commit fails.
        """
        deadline = self._clock() + timeout
        while running() and self._clock() < deadline:
            if serve_group:
                self._serve_group()
            self._collect(block=0.1)
            self._limits.flush()
            self._completer.flush()
            self._completer.serve(0.01)
            self.heartbeat.beat()
        self._completer.wait_recorded(ack_timeout)
        self._completer.wait_acked(ack_timeout)
        # A DLQ record acknowledged just now has queued its key's dead record: written before the commit.
        self._completer.wait_recorded(ack_timeout)

    # ------------------------------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        """Stop fetching, let in-flight tasks finish up to the timeout, record, commit, leave the group."""
        assert self._source is not None
        self._source.pause(list(self._offsets.assigned))
        self._completer.wait_claimed(5.0)
        # Claimed ahead and never started: whoever reads these partitions next claims them at once.
        self._claims.release(self._scheduler.remove_if(lambda t: True) + self._on_hold)
        self._on_hold = []
        if self._running:
            log.info("stopping: waiting for %d running task(s)", len(self._running))
        self._drain(
            lambda: bool(self._running),
            timeout=self.config.shutdown_timeout,
            ack_timeout=10.0,
            serve_group=True,
        )
        # Delivery guarantee: what finished is committed before the group is left. A commit refused while a
        # rebalance is in flight is tried again after serving it (revoked partitions commit in the callback).
        log.info("stopping: committing offsets")
        deadline = self._clock() + 10.0
        while not self._commit() and self._clock() < deadline:
            self._serve_group()
        # Delivery guarantee: what is still running is abandoned here, and its keys freed below. A late
        # outcome (a lease lost to that freeing, say) must never mark its offset done: closing the consumer
        # serves a last revocation, whose commit would then skip the task for good.
        self._offsets.abandon()
        abandoned = list(self._running.values())
        if abandoned:
            # Their attempts end with this process: free the keys now rather than at lease expiry.
            log.warning(
                "shutting down with %d task(s) unfinished; they will run again elsewhere", len(abandoned)
            )
            try:
                self.store.finish(
                    [
                        Finished(
                            t.envelope.idempotency_key,
                            t.attempts,
                            "failed",
                            error="worker shut down",
                            workflow=t.workflow,
                        )
                        for t in abandoned
                    ]
                )
            except StoreUnavailableError as exc:
                log.warning("could not free unfinished keys (their leases will expire): %s", exc)
            for t in abandoned:
                self._limits.release(t.envelope.idempotency_key)
            self._limits.flush()
