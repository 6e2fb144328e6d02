"""The completer: makes attempts' outcomes durable, then tells the worker their offsets may be released;
and claims the keys of newly fetched tasks.

Completions and failures are recorded in Postgres in one round trip per batch; retry and DLQ records are
acknowledged by the broker. A task's offset is released only after that (invariant 1): `record` and
`publish` take the callback that releases it. With a `recorder` store the round trips run on a thread of
their own, so the worker's loop goes on fetching and dispatching while Postgres works; the callbacks
still run on the loop's thread, in `serve` and `settle`.

Claims go the same way: a batch of claims takes the outcomes queued so far with it, and both are sent in
one pipeline (one round trip, one commit) while the loop dispatches what was claimed before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from taskq._core.broker import Record, RecordSink
from taskq._core.errors import RecordTooLargeError, StoreUnavailableError
from taskq._core.logs import OUTAGE
from taskq.consumer.routing import Outgoing
from taskq.consumer.store import Claim, ClaimRequest, Finished, TaskStore

log = logging.getLogger("taskq.worker")

#: Seconds between servings of the producer while no record awaits acknowledgement.
SERVE_IDLE = 0.1
#: Called once the outcome is durable.
Durable = Callable[[], None]
#: Called with a batch's claims, in request order, or with why Postgres could not be asked.
Claimed = Callable[[list[Claim] | StoreUnavailableError], None]
#: Outcomes to record with their callbacks.
_Outcomes = list[tuple[Finished, Durable | None]]
#: Claim batches with their callbacks.
_Claims = list[tuple[list[ClaimRequest], Claimed]]


class Completer:
    """Batches outcome records for the store and publishes retry and DLQ records with acknowledgement."""

    def __init__(
        self,
        store: TaskStore,
        sink: RecordSink,
        *,
        recorder: TaskStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._sink = sink
        self._clock = clock
        self._batch: _Outcomes = []
        self._since = 0.0  # when the oldest queued outcome was queued
        self._recorder = recorder
        self._writing = 0  # outcomes handed to the recorder thread and not yet settled
        self._claiming = 0  # claim requests handed to the recorder thread and not yet settled
        self._to_write: queue.SimpleQueue[tuple[_Outcomes, _Claims] | None] = queue.SimpleQueue()
        # What the recorder thread wrote, and its result; None wakes a wait on it (`wake`).
        self._written: queue.SimpleQueue[tuple[_Outcomes, _Claims, object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._serve_at = 0.0  # when the producer is served next with nothing awaiting acknowledgement

    def record(self, finished: Finished, on_recorded: Durable | None = None) -> None:
        """Queue an attempt's end for the next round trip; `on_recorded` runs once it is in Postgres."""
        if not self._batch:
            self._since = self._clock()
        self._batch.append((finished, on_recorded))

    def publish(
        self,
        out: Outgoing,
        on_acked: Durable,
        *,
        too_large: Callable[[], Outgoing] | None = None,
        on_record: Callable[[Record | None], None] | None = None,
    ) -> None:
        """Send a retry or DLQ record; `on_acked` runs once the broker acknowledged it (sent again if not),
        after `on_record(the record as written: partition and offset)` if given.

        A record the producer refuses as too large is replaced by `too_large()`, a bounded DLQ record:
        the offset still moves on, with a decision on record (invariant 6).
        """

        def delivered(err: str | None, written: Record | None) -> None:
            if err is not None:
                log.error("publishing to %s failed (%s); sending again", out.topic, err)
                self._sink.send(out.topic, out.value, key=out.key, headers=out.headers, on_delivery=delivered)
                return
            if on_record is not None:
                on_record(written)
            on_acked()

        try:
            self._sink.send(out.topic, out.value, key=out.key, headers=out.headers, on_delivery=delivered)
        except RecordTooLargeError as exc:
            if too_large is None:
                raise
            log.warning("%s; dead-lettering a bounded record instead", exc)
            self.publish(too_large(), on_acked, on_record=on_record)

    def claim(self, requests: list[ClaimRequest], on_claimed: Claimed) -> None:
        """Claim keys in the next round trip, with the outcomes queued so far; `on_claimed` runs on the
        loop's thread once Postgres answered (in `serve` or `settle`), or at once without a recorder."""
        if self._recorder is None:
            try:
                claims = self._store.claim(requests)
            except StoreUnavailableError as exc:
                on_claimed(exc)
                return
            on_claimed(claims)
            return
        batch, self._batch = self._batch, []
        self._send(batch, [(requests, on_claimed)])

    def flush(self, linger: float = 0.0) -> None:
        """Write the queued outcomes in one round trip; with Postgres away they wait for the next call.

        With `linger`, only once the oldest has waited that long or 500 are queued: fast tasks finish a
        few at a time, and one statement (one commit) per few milliseconds records them all.
        """
        if not self._batch:
            return
        if linger and len(self._batch) < 500 and self._clock() - self._since < linger:
            return
        batch, self._batch = self._batch, []
        if self._recorder is not None:
            self._send(batch, [])
            return
        try:
            lost = self._store.finish([f for f, _ in batch])
        except StoreUnavailableError as exc:
            self._settle(batch, [], exc)
            return
        self._settle(batch, [], (lost, []))

    def _send(self, batch: _Outcomes, claims: _Claims) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._record_loop, name="taskq-recorder", daemon=True)
            self._thread.start()
        self._writing += len(batch)
        self._claiming += sum(len(requests) for requests, _ in claims)
        self._to_write.put((batch, claims))

    def _record_loop(self) -> None:
        assert self._recorder is not None
        stopping = False
        while not stopping and (work := self._to_write.get()) is not None:
            # What was queued while the last pass ran goes in one round trip: when writing falls behind
            # (a workflow's steps cost a few statements a batch), batches grow instead of the queue.
            passes = [work]
            while True:
                try:
                    more = self._to_write.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                passes.append(more)
            finished = [f for batch, _ in passes for f, _ in batch]
            requests = [r for _, claims in passes for rs, _ in claims for r in rs]
            result: object
            try:
                if requests:
                    result = self._recorder.finish_and_claim(finished, requests)
                else:
                    result = (self._recorder.finish(finished), [])
            except Exception as exc:  # settled on the loop's thread: unavailable is retried, a bug raised
                result = exc
            at = 0
            for batch, claims in passes:
                # Each pass settles with its own claims: the answers are in the order of the passes.
                asked = sum(len(rs) for rs, _ in claims)
                if isinstance(result, tuple):
                    self._written.put((batch, claims, (result[0], result[1][at : at + asked])))
                else:
                    self._written.put((batch, claims, result))
                at += asked

    def _settle(self, batch: _Outcomes, claims: _Claims, result: object) -> None:
        """On the loop's thread: run a written pass's callbacks, or queue its outcomes again (and hand its
        claims back unanswered) if Postgres was away."""
        if isinstance(result, StoreUnavailableError):
            if batch:
                log.warning(
                    "store unavailable, will record %d outcome(s) again: %s", len(batch), result, extra=OUTAGE
                )
                self._batch = batch + self._batch
            for _, on_claimed in claims:
                on_claimed(result)
            return
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, tuple)
        lost: set[str] = result[0]
        for finished, on_recorded in batch:
            if finished.idempotency_key in lost:
                log.warning(
                    "lease of %s was taken over; its outcome was not recorded", finished.idempotency_key
                )
            if on_recorded is not None:
                on_recorded()
        if claims:
            # The pass's claims are its batches' in order: each batch takes its own.
            answered: list[Claim] = result[1]
            at = 0
            for requests, on_claimed in claims:
                on_claimed(answered[at : at + len(requests)])
                at += len(requests)

    def serve(self, timeout: float = 0.0) -> None:
        """Run the callbacks of what was recorded and acknowledged since the last call."""
        self._settle_written(0.0)
        # The producer is served when a record awaits its acknowledgement, or every SERVE_IDLE seconds for
        # its other events (errors): a call per loop pass with nothing to serve cost ~15 µs a task.
        now = self._clock()
        if timeout > 0 or len(self._sink) or now >= self._serve_at:
            self._sink.poll(timeout)
            self._serve_at = now + SERVE_IDLE

    def settle(self, timeout: float = 0.0) -> None:
        """Run the callbacks of what Postgres answered since the last call; with `timeout`, wait that long
        for the first answer if none is there yet (and something is in flight)."""
        self._settle_written(timeout)

    def wake(self) -> None:
        """End a wait in `settle` (from a signal handler: see `Worker._wake`)."""
        self._written.put(None)

    def _settle_written(self, timeout: float) -> None:
        block = timeout
        while self._writing or self._claiming:
            try:
                written = self._written.get(timeout=block) if block > 0 else self._written.get_nowait()
            except queue.Empty:
                return
            block = 0.0
            if written is None:
                continue  # woken
            batch, claims, result = written
            self._writing -= len(batch)
            self._claiming -= sum(len(requests) for requests, _ in claims)
            self._settle(batch, claims, result)

    def claiming(self) -> int:
        """Claim requests sent and not yet answered."""
        return self._claiming

    def wait_claimed(self, timeout: float) -> None:
        """Wait up to `timeout` for every claim in flight to be answered, running their callbacks."""
        deadline = time.monotonic() + timeout
        while self._claiming and time.monotonic() < deadline:
            self._settle_written(deadline - time.monotonic())

    def wait_recorded(self, timeout: float) -> None:
        """Write what is queued and wait up to `timeout` for what the recorder thread is writing."""
        self.flush()
        deadline = time.monotonic() + timeout
        while (self._writing or self._claiming) and time.monotonic() < deadline:
            self._settle_written(deadline - time.monotonic())

    def wait_acked(self, timeout: float) -> int:
        """Wait for every published record's acknowledgement; returns how many are still unacknowledged."""
        return self._sink.flush(timeout)

    def pending(self) -> int:
        """Outcomes not yet recorded, records not yet acknowledged, and claims not yet answered."""
        return len(self._batch) + self._writing + len(self._sink) + self._claiming

    def close(self) -> None:
        """Stop the recorder thread (after `wait_recorded`)."""
        if self._thread is not None:
            self._to_write.put(None)
            self._thread.join(10)
            self._thread = None
