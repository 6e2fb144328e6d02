"""The worker: consume the priority topics in a group, run each task once, commit offsets contiguously.

One thread (the loop) fetches records and passes each batch through the stages, in order, once each:
offsets admit it (`offsets.Offsets`), intake decodes it (`intake.Intake`), claims hold its keys
(`claims.Claims`), dispatch starts the claimed tasks on the executor's slots (`dispatch.Dispatch`), and the
outcomes they report are recorded (`outcomes.Outcomes`), after which their offsets are committed. A task's
offset becomes committable only once its outcome is durable: the completion recorded in Postgres, or its
retry/DLQ record acknowledged by the broker (invariant 1). This module wires the stages and runs the loop.

Longer than 800 lines because the loop's fetch side (records taken in chunks between flow control, the
pausing and resuming of partitions, a saturated tier's partitions resumed in turns, the first dispatch's
wait for every tier and for the slots' connections, the start's smaller buffer and its widening once a task
runs, the wait for records while claims linger), the start (the group join overlapped with the schema check,
the liveness record and the connections opened while the first records are fetched) and the rebalance and
shutdown paths, which reach into every stage, still live here beside the wiring and the lifecycle of the
services the worker runs (forwarder, relay, periodic scheduler, metrics).
"""

from __future__ import annotations

import logging
import math
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
from types import FrameType
from typing import TYPE_CHECKING, Any, cast
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
from taskq.consumer.dispatch import Dispatch
from taskq.consumer.events import (
    Event,
    Hook,
    Hooks,
    LoopSampled,
    PartitionsAssigned,
    PartitionsRevoked,
    Reporter,
    WorkerStarted,
    WorkerStopped,
)
from taskq.consumer.executor import Executor, Outcome
from taskq.consumer.forwarder import Forwarder
from taskq.consumer.handlers import Handlers
from taskq.consumer.intake import Intake, Task, size
from taskq.consumer.limits import Limits
from taskq.consumer.liveness import Liveness
from taskq.consumer.offsets import Offsets, OffsetTracker
from taskq.consumer.outcomes import Outcomes
from taskq.consumer.periodic import PeriodicScheduler, PeriodicSpec
from taskq.consumer.routing import default_worker_id
from taskq.consumer.scheduler import PriorityScheduler
from taskq.consumer.stalls import Watch
from taskq.consumer.store import (
    Finished,
    IdempotencyStore,
    TaskStore,
    WorkerRecord,
)
from taskq.producer.outbox import OutboxRelay
from taskq.schemas.registry import PendingRegistry, Registry, SchemaRegistry, client_config

if TYPE_CHECKING:
    from taskq.consumer.shares import TierShares
    from taskq.producer.producer import TaskProducer

log = logging.getLogger("taskq.worker")

#: Records taken from Kafka at a time once a tier may be saturated by them, with flow control in between:
#: fewer than the smallest reserve of the default weights, so no tier can take another's place for long.
POLL_CHUNK = 16
#: Dispatch waits at most this long (seconds) for newly assigned partitions' first fetch.
SETTLE = 0.5
#: A worker's buffer holds at most this many tasks until its first task starts, then `buffer_capacity`: the
#: first wave waits for every tier's records (invariant 4) and for their claims, and a larger buffer is
#: more of both to wait for (launch to first task 0.28 s at 500, 0.39 s at 2,000 and 0.53 s at 4,000).
START_BUFFER = 500
#: Share mode: records acquired beyond what can start are released after this long (seconds).
SHED_AFTER = 5.0
#: How often the loop's state is sampled (LoopSampled: the in-flight, slot and buffer gauges). Once per
#: tick, the sample and its gauges cost more than the tick's own bookkeeping in a burn-down (a tick per
#: 8 tasks); a scrape every few seconds sees no difference.
SAMPLE_EVERY = 0.1


class ServiceStoppedError(TaskqError):
    """A service the worker runs beside its loop (the delay forwarder, say) stopped on its own."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How a worker runs; validated when created."""

    concurrency: int = 4
    group: str | None = None
    weights: Mapping[Priority, int] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    #: At most this many fetched tasks wait for a slot; beyond it partitions are paused (invariant 5).
    #: Each pause drops the records librdkafka fetched ahead for the partition, and its resume fetches them
    #: again: a tier's reserve is its share of half of this, and a burn-down cycled the small tiers through
    #: a pause every few tasks of theirs at 500 (0.089 ms of worker CPU a no-op task; 0.073 at 2,000).
    buffer_capacity: int = 2000
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
    #: A fetched task's claim waits up to this long (seconds) for the tasks fetched after it, to go to
    #: Postgres in one round trip with them (at once when CLAIM_ENOUGH are waiting). 0, the default, sends
    #: every pass's claims at once: the consumer's fetches already wait up to 5 ms for their records to
    #: share them (`fetch.min.bytes`, `consumer_config`), which saves more (librdkafka's and the loop's
    #: wakeups as well as round trips), and the two waits would add up. Only with claims on a thread of
    #: their own (the Postgres store's recorder).
    claim_linger: float = 0.0
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
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"metrics_port must be a port from 0 to 65535, got {self.metrics_port}")
        if not 0 <= self.claim_linger <= 1:
            raise ConfigurationError(f"claim_linger must be from 0 to 1 second, got {self.claim_linger}")
        if self.result_max_bytes < 16:
            raise ConfigurationError(f"result_max_bytes must be >= 16, got {self.result_max_bytes}")
        if not self.stale_after >= 2 * self.heartbeat_interval:
            raise ConfigurationError(
                f"stale_after must be at least twice heartbeat_interval ({self.heartbeat_interval} s), "
                f"got {self.stale_after}"
            )


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

        Every event goes to `hooks`, each as it happens. The worker's Prometheus metrics (`self.metrics`) take
        the worker's events as a hook and count per-task ones without an event, applied once per loop pass;
        with no `hooks`, no per-task event is built.
        """
        self.handlers = handlers
        self.settings = settings or Settings.from_env()
        self.config = config or WorkerConfig()
        self.topics = Topics(self.settings.namespace, self.settings.delay_tiers)
        self.group = self.config.group or self.settings.worker_group
        self.worker_id = self.config.worker_id
        self.metrics = metrics.PrometheusHook()
        self._hooks = Hooks((self.metrics, *hooks))
        # Per-task events are built only for `hooks`; the metrics count them into their tally instead.
        self._report = Reporter(self.metrics.tally, hooks)
        self._tracer = Tracer()
        self._stop = threading.Event()
        #: Attempts' outcomes, from the slots; None wakes a wait on it (`_wake`).
        self._outcomes: queue.SimpleQueue[tuple[Task, Outcome] | None] = queue.SimpleQueue()
        self._scheduler: PriorityScheduler[Task] = PriorityScheduler(
            weights=self.config.weights, capacity=min(self.config.buffer_capacity, START_BUFFER)
        )
        self._offsets = Offsets(self._emit)
        self._arrived: list[Task] = []  # decoded this tick, to claim in one round trip
        self._paused: set[TP] = set()
        self._resume_at: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)  # depth a paused tier resumes at
        self._fresh: set[TP] = set()  # assigned since the last flow control: pause state unknown
        self._settling: dict[TP, float] = {}  # assigned, not fetched yet: when they were assigned
        self._dispatched = False  # nothing started yet: the first dispatch waits for every tier's partitions
        self._first_assigned: float | None = None
        self._slots_ready: threading.Event | None = None  # set once every pool thread is prepared (start)
        self._fed: dict[Priority, float] = dict.fromkeys(PRIORITIES, -float("inf"))  # last record taken
        # Per tier, its partitions that delivered records in the current round of its resumes (`_turn`).
        self._served: dict[Priority, set[TP]] = {tier: set() for tier in PRIORITIES}
        self._fetching: set[Priority] = set()  # tiers with a partition assigned and not paused
        # Flow control's view of the assignment: each tier's partitions (as of the assignment's nth change),
        # and how many of them are not paused.
        self._partitions_of: tuple[int, dict[Priority, list[TP]]] = (-1, {})
        self._unpaused: dict[Priority, int] = dict.fromkeys(PRIORITIES, 0)
        self._sampled_at = float("-inf")  # when the loop was last sampled for its gauges (LoopSampled)
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
        self._claim_linger = self.config.claim_linger if recorder is not None else 0.0
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
            lambda: len(self._dispatcher.running),
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
            report=self._report,
            done=lambda task, dead: self._dispatcher.done(task, dead=dead),
            lift=lambda task: self._dispatcher.lift_quarantine(task),
        )
        self._claims = Claims(
            self.store,
            self._completer,
            self._outcome_stage,
            self._offsets,
            claim_wait=self.config.claim_wait,
            default_lease=self.config.default_lease,
            report=self._report,
            clock=clock,
            done=lambda task: self._dispatcher.done(task),
            ready=lambda tasks: self._dispatcher.ready(tasks),
        )
        self._dispatcher = Dispatch(
            self._scheduler,
            self.executor,
            self._claims,
            self._limits,
            self.store,
            self._completer,
            self._offsets,
            self._tracer,
            self._outcomes,
            config=self.config,
            group=self.group,
            group_commits=any(s.transactional and s.group_commit for s in handlers),
            stop=self._stop,
            report=self._report,
            clock=clock,
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
        self._watch = Watch(
            self._offsets,
            self._dispatcher,
            self._claims,
            self.topics,
            paused=self._paused,
            undecoded=lambda: self._undecoded,
            arrived=lambda: self._arrived,
        )

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
    def _running(self) -> dict[int, Task]:
        """Attempts started and not reported yet (in the dispatch stage), by id of their task."""
        return self._dispatcher.running

    def _dispatch(self) -> None:
        """Start what may start now (the dispatch stage)."""
        self._dispatcher.dispatch()

    def _done(self, task: Task, *, dead: bool = False) -> None:
        """The task's outcome is durable (the dispatch stage frees its key; its offset moves on)."""
        self._dispatcher.done(task, dead=dead)

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
            # Set before the line is logged: a second signal that lands while it is written runs this handler
            # again, nested, and must find the first one counted (CI saw both logged and no exit at once).
            self._stop.set()
            self._wake()
            log.info(
                "signal %s: stopping (finishing in-flight tasks, up to %ss)",
                signum,
                self.config.shutdown_timeout,
            )

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def _wake(self) -> None:
        """End the loop's wait for outcomes or Postgres's answers, from a signal handler. CPython 3.11's
        SimpleQueue.get(timeout=...) waits for ever once a handler run inside it outlasts the timeout (it
        goes on with a negative one): a SIGTERM logged slowly left the loop waiting for an outcome that
        might never come, and the worker never stopped. An item in each queue ends the wait."""
        self._outcomes.put(None)
        self._completer.wake()

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
            if any(spec.transactional for spec in self.handlers):
                # Every slot's connection for transactional attempts is opened now, on its pool thread,
                # while the group is joined: opened at each thread's first attempt, the connects held the
                # first wave's groups back by different amounts, and their effects left the weighted order.
                self._slots_ready = self.executor.prepare_threads(self.store.prepare_thread)
            self._liveness.start()
            for store in (self.store, self._recorder):
                if isinstance(store, IdempotencyStore):
                    # Opened now, each in a thread, while the first records are fetched: the loop's first
                    # read (an operator's pauses) and the first claims would otherwise each wait for a
                    # connect as the first records arrive.
                    store.database.warm()
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
        # Imported here: with its admin client, 5 ms of every other worker's start.
        from taskq.consumer.shares import TierShares

        return TierShares(
            self.broker,
            consumers=max(2, self.config.concurrency),
            max_poll_records=self.config.concurrency,
            on_assign=self._assigned_cb,
            lock_duration_ms=self.config.share_lock_ms,
        )

    def _start_periodic(self, database: Database) -> tuple[PeriodicScheduler, threading.Thread, TaskProducer]:
        # Slots are staged in the outbox, in the transaction that advances the schedule: the relay publishes.
        from taskq.producer.producer import (
            TaskProducer,
        )  # only for periodic tasks: not on every worker's start

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
            self._dispatcher.running
            or self._claims.held
            or self._limits.pending()
            or self._dispatcher.on_hold
            or self._undecoded
            or self._completer.pending()
            or self._claims.queued()
            or len(self._scheduler)
            or self._offsets.pending()
        )

    def waiting_until(self) -> float | None:
        """When the worker has nothing to do but wait for held tasks, or for the slots and tokens of its
        limited tasks' keys: the clock time the first may go on."""
        if self._dispatcher.running or self._undecoded or self._completer.pending():
            return None
        dues = [h.due for h in self._claims.held]
        left = self._claims.linger_left()
        if left is not None:
            dues.append(self._clock() + left)
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
            # Leaving serves a last revocation, whose callback commits through the consumer: it is let go
            # only once closed.
            try:
                self._source.close()
            except TaskqError as exc:  # refused or away: what finished is committed; the rest is released
                log.warning("leaving the group: %s", exc)
            finally:
                self._source = None
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
        self.metrics.flush()  # what the last passes counted (under --processes, its supervisor serves it)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._emit(WorkerStopped(self.worker_id))

    def _emit(self, event: Event) -> None:
        self._hooks.emit(event)

    # ------------------------------------------------------------------------------------------------ loop
    def _tick(self) -> None:
        self.heartbeat.beat()
        assert self._source is not None
        waiting = self._waiting()
        busy = bool(self._dispatcher.running or waiting or self._completer.pending())
        capacity = self._scheduler.capacity
        room = max(1, min(500, capacity - waiting))
        starting = not self._dispatched and bool(self._settling)
        if starting:
            # Before the first dispatch, tiers short of their reserve are fetched at once even with the
            # buffer full (the full tiers are paused, so only theirs come): the first dispatch waits for them.
            room = max(room, POLL_CHUNK)
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
        if room >= capacity // 4 or not busy or due or starting or self._short():
            self._last_poll = now
            # consume(n, timeout) waits for all n records or the timeout: take what is there, and block only
            # for one record (then the rest that came with it), never on a timeout. Block while idle, and
            # while slots are free with nothing buffered for them: what starts next is a record on its way,
            # and consume() returns the moment it arrives (running tasks' outcomes wait for it, at most 5 ms).
            records = self._take(room)
            lingering = self._claims.linger_left()
            if not records and lingering is not None and self._starved():
                # Claims wait for the records on their way to share their round trip: take every record
                # that comes until they are due, in one pass (consume() returns at `room` or the deadline).
                records = self._take_until(room, lingering)
                waited = True
            elif not records and (not busy or self._starved()):
                records = self._source.poll(1, 0.005 if busy else 0.25)
                waited = True
                if records and room > 1:
                    records += self._take(room - 1, records)
        self._take_in(self._intake.retry_ready(), tracked=True)
        self._arrived_from(records)
        self._take_in(records)
        self._claim_arrived()
        self._dispatcher.read_pauses()
        self._flow_control()
        self._claims.release_due()
        self._completer.settle()  # what earlier claims answered goes into the buffers first
        if self._settled():
            self._dispatcher.dispatch()
            if self._scheduler.capacity < self.config.buffer_capacity and self._dispatcher.running:
                # Running now: the whole buffer, and the tiers paused at the start's bound resume at once.
                # Not sooner: the first dispatch may wait for its claims' answer, and the next pass would
                # take and decode a buffer's worth of records first.
                self._scheduler.resize(self.config.buffer_capacity)
                self._resume_at = dict.fromkeys(PRIORITIES, self.config.buffer_capacity)
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
                self._completer.settle(self._until_claims(0.005))
            else:
                # Nothing new from Kafka: sleep until a running task reports (wakes at once), not a tick.
                self._collect(block=self._until_claims(0.005 if self.executor.free_slots() else 0.05))
        # The pass's per-task counts go to Prometheus once, not an update per event: /metrics lags a pass.
        self.metrics.flush()

    def _waiting(self) -> int:
        """Records in the buffer: waiting for a slot, held, undecoded or being claimed."""
        waiting = len(self._scheduler) + len(self._claims.held) + len(self._dispatcher.on_hold)
        return waiting + len(self._undecoded) + self._completer.claiming() + self._claims.queued()

    def _take_until(self, room: int, seconds: float) -> list[Record]:
        """Up to `room` records, waiting up to `seconds` for the first POLL_CHUNK of them; if that many came,
        the rest that Kafka has fetched, as `_take` takes them (flow-controlled between chunks)."""
        assert self._source is not None
        # Kafka's waits are whole milliseconds, cut short: rounded up, the wait ends when the claims are due,
        # not just before (and then again and again with no wait at all).
        first = self._source.poll(min(room, POLL_CHUNK), math.ceil(seconds * 1000) / 1000)
        if len(first) < min(room, POLL_CHUNK):
            return first
        return first + self._take(room - len(first), first)

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
        waited SETTLE seconds for it, or the buffer is full).

        Until then nothing starts: a worker that starts on a backlog would otherwise run the first tier
        fetched (librdkafka may even assign a group's partitions topic by topic) alone, before the others'
        records arrive a few milliseconds later (invariant 4).
        """
        if self._first_assigned is None:
            return True  # nothing assigned, nothing to start
        assert self._source is not None
        now = self._clock()
        if not self._dispatched:
            ready = self._slots_ready
            if ready is not None and not ready.is_set() and now - self._first_assigned < SETTLE:
                return False  # the slots' connections are being opened (start): the first wave waits for them
            tiers = {self.topics.priority_of(t) for t, _ in self._offsets.assigned} - {None}
            if len(tiers) < len(PRIORITIES) and now - self._first_assigned < SETTLE:
                return False
        if self._settling and self._waiting() >= self._scheduler.capacity:
            # The buffer is full (the first tiers fetched filled it): a partition is waited for only while
            # its tier holds less than its reserve, and the loop takes such tiers' records at once while it
            # starts (`_starting`). A worker started on a backlog stood still for SETTLE waiting for tiers
            # that had their share; started without waiting at all, it ran a short tier below its weight
            # for the first hundreds of tasks.
            scheduler = self._scheduler
            self._settling = {
                tp: at
                for tp, at in self._settling.items()
                if (tier := self.topics.priority_of(tp[0])) is not None
                and scheduler.depth(tier) < scheduler.reserve(tier)
            }
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
        for tp in {(r.topic, r.partition) for r in records}:
            tier = self.topics.priority_of(tp[0])
            if tier is not None:
                self._fed[tier] = now
                self._served[tier].add(tp)
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
        """Claim the keys of the tasks decoded this tick, all in one round trip, or with those of the next
        ticks within `claim_linger`: only while nothing waits in the buffer for a slot, and not before the
        first dispatch (the start waits for nothing). With tasks buffered, a tier whose refetched records
        lingered ran dry meanwhile and the others took its turns (invariant 4)."""
        linger = self._claim_linger if self._dispatched and not len(self._scheduler) else 0.0
        if self._arrived:
            arrived, self._arrived = self._arrived, []
            self._claims.claim(arrived, linger=linger)
        if linger:
            self._claims.send_due()
        else:
            self._claims.send_queued()

    def _until_claims(self, seconds: float) -> float:
        """`seconds`, or less if queued claims are due sooner: a wait in the loop never holds them."""
        left = self._claims.linger_left()
        return seconds if left is None else min(seconds, left)

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
        waiting = len(self._scheduler) + len(self._claims.held) + len(self._dispatcher.on_hold)
        full = waiting + (sum(incoming.values()) if incoming else 0) >= self._scheduler.capacity
        held = Counter(self.topics.priority_of(h.task.record.topic) for h in self._claims.held if full)
        held.update(t.tier for t in self._dispatcher.on_hold if full)
        # Over the byte bound every partition waits: what is buffered runs first, then fetching resumes.
        heavy = self._over_bytes() or self._stop.is_set()
        # Decided per tier, then applied to its partitions: the rule reads every tier's depth, and a worker
        # holds tens of partitions.
        depths: dict[Priority, int] = {}
        halt: dict[Priority, bool] = {}
        for tier in PRIORITIES:
            depth = depths[tier] = self._scheduler.depth(tier) + (incoming or {}).get(tier, 0)
            over = full and held[tier] + depth >= self._scheduler.reserve(tier)
            paused = tier in self._dispatcher.pauses.tiers  # by an operator: nothing more is fetched
            halt[tier] = heavy or over or paused or self._scheduler.saturated(tier, incoming)
        fresh, stopped = self._fresh, self._paused
        for tier, tps in self._tier_partitions().items():
            depth = depths[tier]
            resume = self._unpaused[tier] < len(tps) and depth <= self._resume_at[tier]
            if halt[tier]:
                if self._unpaused[tier]:
                    to_pause += [tp for tp in tps if tp not in stopped]
                    self._resume_at[tier] = depth * 3 // 4
            elif fresh or resume:
                # Hysteresis: a paused tier resumes once a quarter of what it held has run, early enough
                # for the refetch to arrive before it runs dry. Pausing drops the partition's prefetched
                # records, so resuming at the first free place made every poll a pause and a refetch; at
                # half, one dispatch of group commits (a wave of 8 groups: about critical's whole half) left
                # critical or high empty until the refetch came, in 3 of 24 runs of the weights test on a
                # quiet machine (0 of 24 at three quarters).
                # Of its paused partitions, those whose turn it is (`_turn`).
                turn = self._turn(tier, tps, depth) if resume else ()
                to_resume += [tp for tp in tps if tp in fresh or tp in turn]
        if to_pause or to_resume or fresh:
            self._source.pause(to_pause)
            self._source.resume(to_resume)
            self._paused |= set(to_pause)
            self._paused -= set(to_resume)
            self._count_unpaused()
        fresh.clear()

    def _turn(self, tier: Priority, tps: list[TP], depth: int) -> list[TP]:
        """Of a tier's paused partitions, those it resumes now (`depth`: the tasks it holds). A resume goes
        in two steps: first the partitions whose turn it is (records to read, none delivered in this round of
        the tier's resumes), then the others, once the tier holds less than its reserve. Once every partition
        has delivered, a new round.

        A tier is paused once its share of the buffer is taken, and one partition's fetch (64 KB) can hold
        that share whole: the pause drops what the other partitions fetched, and librdkafka fetches for the
        partitions in an order of its own. Resumed all at once, a saturated tier was read from its first
        partitions until they ran dry, and the tasks of its last ones waited for as long as it stayed
        saturated (one partition of `low` unread for over a minute at 8,000 tasks a second). Resumed first,
        the turn's partitions have the tier's fetches to themselves while it still holds its share (a fetch
        brought more than that); a tier short of its share takes every partition's records, so a backlog
        spread thin over many partitions refills it in time (resumed only in turns, a no-op burn-down over
        24 partitions ran 30% slower, its tiers running dry).
        """
        assert self._source is not None
        stopped = [tp for tp in tps if tp in self._paused]
        if self._shares is not None:
            return stopped  # a share group's tiers pause whole: no turns
        if len(stopped) < len(tps):
            # The second step, once the tier holds less than its reserve: until then its share is buffered,
            # and the turn's partitions keep its fetches to themselves.
            return stopped if depth < self._scheduler.reserve(tier) else []
        served = self._served[tier]
        unserved = [tp for tp in stopped if tp not in served]
        if unserved:
            # End offsets as last seen, without a request: a partition whose end is stale (not fetched since
            # more came) waits for the next round.
            ends = self._source.high_watermarks(unserved)
            turn = [tp for tp in unserved if ends[tp] < 0 or ends[tp] > self._source.position(tp)]
            if turn:
                return turn
        served.clear()
        return stopped

    def _tier_partitions(self) -> dict[Priority, list[TP]]:
        """The assigned partitions of each tier (of priority topics only), derived again when they change."""
        if self._partitions_of[0] != self._offsets.changes:
            by_tier: dict[Priority, list[TP]] = {tier: [] for tier in PRIORITIES}
            for tp in sorted(self._offsets.assigned):
                tier = self.topics.priority_of(tp[0])
                if tier is not None:
                    by_tier[tier].append(tp)
            self._partitions_of = (self._offsets.changes, {t: tps for t, tps in by_tier.items() if tps})
            self._count_unpaused()
        return self._partitions_of[1]

    def _count_unpaused(self) -> None:
        """Each tier's partitions being fetched (not paused), and the tiers that have any (`_fetching`)."""
        paused, partitions = self._paused, self._partitions_of[1]
        self._unpaused = {
            tier: sum(tp not in paused for tp in partitions.get(tier, ())) for tier in PRIORITIES
        }
        self._fetching = {tier for tier, n in self._unpaused.items() if n}

    def _over_bytes(self) -> bool:
        """Whether the buffered records (waiting, held, undecoded) take more than `buffer_bytes`."""
        on_hold = self._dispatcher.on_hold
        waiting = len(self._scheduler) + len(self._claims.held) + len(on_hold) + len(self._undecoded)
        if waiting * self._intake.largest < self.config.buffer_bytes:
            return False  # cannot be over whatever their sizes: no need to add them up (the usual case)
        total = sum(size(t.record) for t in self._scheduler) + sum(size(t.record) for t in on_hold)
        total += sum(size(h.task.record) for h in self._claims.held) + sum(size(r) for r in self._undecoded)
        return total >= self.config.buffer_bytes

    def _collect(self, block: float) -> None:
        """Take the outcomes reported so far (waiting up to `block` for the first) as one batch, and hand it
        to the outcomes stage; group members past their group's window go back to the buffer instead."""
        try:
            first = self._outcomes.get(timeout=block) if block > 0 else self._outcomes.get_nowait()
        except queue.Empty:
            return
        reported = [] if first is None else [first]
        while True:
            try:
                item = self._outcomes.get_nowait()
            except queue.Empty:
                break
            if item is not None:  # (None only wakes)
                reported.append(item)
        if not reported:
            return
        ended, unstarted = self._dispatcher.ended(reported)
        again = self._outcome_stage.settle(ended, self._clock())
        self._claims.held.extend(Held(task, due) for task, due in again)
        self._claims.release(unstarted)

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
        """Sample the loop's state for the gauges (LoopSampled), every SAMPLE_EVERY seconds at most."""
        now = self._clock()
        if now - self._sampled_at < SAMPLE_EVERY:
            return
        self._sampled_at = now
        lag: dict[Priority, int] | None = None
        if self._source is not None and now - self._last_lag >= 5.0:
            self._last_lag = now
            # In share mode the broker keeps the records' place: nothing of the partitions' to watch.
            self._watch.look(now, cast("RecordSource", self._source) if self._shares is None else None)
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
        self._dispatcher.revoking = revoked
        # Claims on their way land in the buffers first, so the claimed keys of revoked partitions are
        # given back with the rest (one answered later is given back by the claims stage).
        self._claims.send_queued()
        self._completer.wait_claimed(5.0)
        dropped = self._dispatcher.drop(revoked)
        # Claimed ahead and never started: the partition's new owner claims them at once, same attempt.
        self._claims.release(dropped)
        self._claims.forget(revoked)
        self._intake.forget(revoked)
        self._drain(
            lambda: any(t.record.tp in revoked for t in self._dispatcher.running.values()),
            timeout=self.config.revoke_timeout,
            ack_timeout=5.0,
        )
        try:
            self._commit(revoked)
        except Exception as exc:  # a lost partition cannot be committed; its new owner redoes the rest
            log.warning("commit on revoke failed: %s", exc)
        self._offsets.revoke(revoked)
        self._paused -= revoked
        self._dispatcher.revoking = set()
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
            self.metrics.flush()
        self._completer.wait_recorded(ack_timeout)
        self._completer.wait_acked(ack_timeout)
        # A DLQ record acknowledged just now has queued its key's dead record: written before the commit.
        self._completer.wait_recorded(ack_timeout)

    # ------------------------------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        """Stop fetching, let in-flight tasks finish up to the timeout, record, commit, leave the group."""
        assert self._source is not None
        self._source.pause(list(self._offsets.assigned))
        self._claims.send_queued()
        self._completer.wait_claimed(5.0)
        # Claimed ahead and never started: whoever reads these partitions next claims them at once.
        self._claims.release(self._dispatcher.drop_all())
        if self._dispatcher.running:
            log.info("stopping: waiting for %d running task(s)", len(self._dispatcher.running))
        self._drain(
            lambda: bool(self._dispatcher.running),
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
        abandoned = list(self._dispatcher.running.values())
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
