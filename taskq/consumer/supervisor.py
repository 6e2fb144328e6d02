"""`taskq worker --processes N`: N worker processes in one consumer group, under one supervisor.

The supervisor starts each worker process (spawn: nothing of its own threads' state is inherited), serves one
/metrics for all of them, restarts one that dies, and stops them all gracefully on SIGTERM/SIGINT. A worker
process is a full `Worker` with its own worker id; it dies with the supervisor, runs the delay forwarder only
if it is process 0, and takes its shutdown from the supervisor alone: it ignores SIGINT (Ctrl-C reaches the
whole process group) and treats every SIGTERM as the first (systemd signals the whole cgroup, and the
supervisor forwards what it gets), so killing is the supervisor's decision, on a second signal.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIServer

from taskq._core.errors import ConfigurationError, KafkaAuthenticationError, TaskqError
from taskq._core.settings import Settings
from taskq.consumer import metrics
from taskq.consumer.executor._process import die_with_parent
from taskq.consumer.handlers import load
from taskq.consumer.routing import default_worker_id
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.schemas.errors import SchemaError

log = logging.getLogger("taskq.supervisor")

# spawn, never fork: the supervisor may run the metrics thread, and a worker process starts its own clients.
_MP = multiprocessing.get_context("spawn")
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# A worker process's exit code when restarting it cannot help (EX_CONFIG): its configuration is refused, by
# Kafka (credentials, TLS) or by the project's own checks. The supervisor gives up at once, with its reason.
REFUSED = 78
#: Seconds past the shutdown timeout a stopping worker process is given before it is killed.
STOP_MARGIN = 15.0


class WorkerProcessesFailedError(TaskqError):
    """A worker process kept dying; the supervisor stopped the others and gave up."""


class RestartBackoff:
    """When to restart a worker process that died, and when to give up on it (pure: the clock is passed in).

    The first restart waits `first` seconds, each next one twice as long, up to `cap`; a process that had run
    for `healthy_after` seconds before it died starts over at `first`. Its `max_deaths`-th death within
    `window` seconds means: give up.
    """

    def __init__(
        self,
        *,
        first: float = 1.0,
        cap: float = 30.0,
        healthy_after: float = 60.0,
        max_deaths: int = 5,
        window: float = 60.0,
    ) -> None:
        self.first, self.cap, self.healthy_after = first, cap, healthy_after
        self.max_deaths, self.window = max_deaths, window
        self._delay = first
        self._deaths: list[float] = []

    def died(self, now: float, ran: float) -> float | None:
        """Record a death at `now` after `ran` seconds of running: seconds until the restart, or None."""
        if ran >= self.healthy_after:
            self._delay = self.first
        self._deaths = [t for t in self._deaths if now - t < self.window] + [now]
        if len(self._deaths) >= self.max_deaths:
            return None
        delay, self._delay = self._delay, min(self._delay * 2, self.cap)
        return delay


@dataclass
class _Slot:
    """Worker process number `index`: the process running now, or when the next one starts."""

    index: int
    backoff: RestartBackoff
    process: BaseProcess | None = None
    started: float = 0.0
    restart_at: float | None = None
    exitcode: int | None = None  # of the last process, once stopped


class Supervisor:
    """Runs `processes` workers of the handlers at MODULE:ATTR in one consumer group until SIGTERM/SIGINT."""

    def __init__(
        self,
        handlers_path: str,
        settings: Settings,
        config: WorkerConfig,
        *,
        processes: int,
        setup: Callable[[], None] | None = None,
    ) -> None:
        """`config` is every process's, except that each gets its own worker id, only process 0 runs the
        forwarder, and `metrics_port` is the supervisor's. `setup` (picklable, e.g. logging configuration)
        runs first in each worker process."""
        if processes < 1:
            raise ConfigurationError(f"processes must be >= 1, got {processes}")
        self.handlers_path = handlers_path
        self.settings = settings
        self.config = config
        self.setup = setup
        self._slots = [_Slot(i, RestartBackoff()) for i in range(processes)]
        self._refusals = _MP.SimpleQueue()  # a refused worker process's one-line reason, put before it exits
        self._stopping = False
        self._healthy = False  # read by /healthz
        self._metrics_dir: str | None = None

    def run(self) -> int:
        """Start the worker processes and supervise them until they stopped: 0 if each stopped cleanly,
        128 + the signal if a second signal killed them. WorkerProcessesFailedError if one kept dying."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        # The signal's number lands in the pipe (at C level, so none is lost between two checks of the loop).
        previous = {s: signal.signal(s, lambda signum, frame: None) for s in _STOP_SIGNALS}
        previous_fd = signal.set_wakeup_fd(wake_w)
        previous_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        server: WSGIServer | None = None
        try:
            if self.config.metrics_port is not None:
                # Read by each worker process when it imports prometheus_client: every value it creates,
                # whatever its registry, is kept in this directory, which the supervisor's /metrics sums.
                self._metrics_dir = tempfile.mkdtemp(prefix="taskq-metrics-")
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
                server = self._serve(self._metrics_dir)
            log.info(
                "supervisor: %d worker processes of %s, group %s",
                len(self._slots),
                self.handlers_path,
                self.config.group or self.settings.worker_group,
            )
            for slot in self._slots:
                self._start(slot)
            return self._supervise(wake_r)
        finally:
            self._reap_all()  # only an error in the supervisor itself leaves processes running here
            signal.set_wakeup_fd(previous_fd)
            for s, handler in previous.items():
                signal.signal(s, handler)
            os.close(wake_r)
            os.close(wake_w)
            if server is not None:
                server.shutdown()
                server.server_close()
            if self._metrics_dir is not None:
                if previous_env is None:
                    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
                else:
                    os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_env
                shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _supervise(self, wake: int) -> int:
        failure: str | None = None
        killed_by: int | None = None
        # Once stopping, what has not stopped by then is killed: a worker process that never answers SIGTERM
        # (hung in a C call, its signals still blocked) kept the supervisor waiting for ever, even one that
        # had given up on a process that kept dying.
        kill_at: float | None = None
        overdue = False
        while True:
            running = [s for s in self._slots if s.process is not None]
            if self._stopping and not running:
                break
            self._healthy = not self._stopping and len(running) == len(self._slots)
            if self._stopping and kill_at is None:
                kill_at = time.monotonic() + self.config.shutdown_timeout + STOP_MARGIN
            due = [s.restart_at for s in self._slots if s.restart_at is not None]
            if kill_at is not None and not overdue and killed_by is None:
                due.append(kill_at)
            timeout = max(0.0, min(due) - time.monotonic()) if due else None
            wait([*(s.process.sentinel for s in running if s.process), wake], timeout)
            for signum in _signals(wake):
                name = signal.Signals(signum).name
                if not self._stopping:
                    log.info(
                        "%s: stopping %d worker process(es) (each finishes in-flight tasks, up to %g s); "
                        "a second signal kills them",
                        name,
                        len(running),
                        self.config.shutdown_timeout,
                    )
                    self._stop_all()
                elif killed_by is None:
                    log.warning("second signal (%s): killing the worker processes", name)
                    killed_by = signum
                    for slot in self._slots:
                        if slot.process is not None:
                            slot.process.kill()
            if kill_at is not None and not overdue and killed_by is None and time.monotonic() >= kill_at:
                overdue = True
                for slot in running:
                    if slot.process is not None and slot.process.exitcode is None:
                        log.warning(
                            "worker process %d (pid %s) did not stop within %g s: killing it",
                            slot.index,
                            slot.process.pid,
                            self.config.shutdown_timeout + STOP_MARGIN,
                        )
                        slot.process.kill()
            for slot in running:
                assert slot.process is not None
                if slot.process.exitcode is not None:
                    failure = self._reaped(slot) or failure
            now = time.monotonic()
            for slot in self._slots:
                if slot.restart_at is not None and slot.restart_at <= now and not self._stopping:
                    self._start(slot)
        if failure is not None:
            raise WorkerProcessesFailedError(failure)
        if killed_by is not None:
            return 128 + killed_by
        return 0 if all(s.exitcode in (None, 0) for s in self._slots) else 1

    def _start(self, slot: _Slot) -> None:
        process = _MP.Process(
            target=_worker_process,
            args=(slot.index, self.handlers_path, self.settings, self.config, os.getpid(), self.setup,
                  self._refusals),
            name=f"taskq-worker-{slot.index}",
        )
        # Blocked until the worker process installs its own handlers (it inherits the mask): a Ctrl-C or a
        # SIGTERM while it starts waits for them instead of killing it with a traceback. Spawn's resource
        # tracker unblocks both once it has started, so it is started first.
        resource_tracker.ensure_running()
        with _blocked(_STOP_SIGNALS):
            process.start()
        slot.process, slot.started, slot.restart_at = process, time.monotonic(), None
        log.info("worker process %d started: pid %s", slot.index, process.pid)

    def _reaped(self, slot: _Slot) -> str | None:
        """A worker process exited: record it, and schedule its restart unless stopping; the failure
        message if it kept dying."""
        process = slot.process
        assert process is not None and process.exitcode is not None
        pid, code = process.pid, process.exitcode
        process.join()
        process.close()
        slot.process = None
        if self._metrics_dir is not None:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(pid, self._metrics_dir)  # type: ignore[no-untyped-call]  # its live gauges go
        if self._stopping:
            slot.exitcode = code
            (log.info if slot.exitcode == 0 else log.warning)(
                "worker process %d (pid %s) stopped: %s", slot.index, pid, _status(code)
            )
            return None
        if code == REFUSED:
            reason = f"worker process {slot.index} refused"
            if not self._refusals.empty():
                reason = self._refusals.get()
            log.error("%s: restarting cannot help; stopping the others, then giving up", reason)
            self._stop_all()
            return f"{reason}; restarting cannot help: stopped the others and gave up"
        now = time.monotonic()
        delay = slot.backoff.died(now, now - slot.started)
        if delay is None:
            b = slot.backoff
            failure = (
                f"worker process {slot.index} died {b.max_deaths} times within {b.window:g} s "
                f"(last: pid {pid}, {_status(code)})"
            )
            log.error("%s: stopping the others, then giving up", failure)
            self._stop_all()
            return f"{failure}; stopped the others and gave up"
        log.warning(
            "worker process %d (pid %s) died after %.1f s: %s; restarting it in %g s",
            slot.index,
            pid,
            now - slot.started,
            _status(code),
            delay,
        )
        slot.restart_at = now + delay
        return None

    def _stop_all(self) -> None:
        """Forward SIGTERM to each running worker process; start no more."""
        self._stopping = True
        self._healthy = False
        for slot in self._slots:
            slot.restart_at = None
            if slot.process is not None:
                slot.process.terminate()

    def _reap_all(self) -> None:
        """Stop and reap whatever still runs: gracefully, then, past the shutdown timeout, by SIGKILL."""
        running = [s.process for s in self._slots if s.process is not None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + self.config.shutdown_timeout + STOP_MARGIN
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()

    def _serve(self, path: str) -> WSGIServer:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
        assert self.config.metrics_port is not None
        # /healthz: 200 while every worker process runs (a dead one is being restarted: 503 until it is).
        return metrics.serve(
            self.config.metrics_port, lambda: self._healthy, host=self.config.metrics_host, registry=registry
        )


@contextlib.contextmanager
def _blocked(signals: set[signal.Signals]) -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _signals(wake: int) -> list[int]:
    """The signals written to the wake-up pipe since the last call."""
    try:
        return list(os.read(wake, 512))
    except BlockingIOError:
        return []


def _status(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


# -- the worker process -----------------------------------------------------------------------------------


def _worker_process(*args: Any) -> None:
    """Entry point of a worker process (see `_serve`), which ends it at once with its code, without the
    interpreter's finalization, as the taskq command ends a worker's process: by then it has closed its
    clients, or it failed and said why. Kafka client objects left to finalization (threads of theirs still
    calling back into Python) crashed a refused worker with SIGSEGV on its way out (2 of 86 runs), and its
    supervisor restarted it instead of giving up."""
    code = 1
    try:
        _serve(*args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(
    index: int,
    handlers_path: str,
    settings: Settings,
    config: WorkerConfig,
    parent_pid: int,
    setup: Callable[[], None] | None,
    refusals: multiprocessing.SimpleQueue[str],
) -> None:
    """One Worker, stopped gracefully by the supervisor's SIGTERM."""
    die_with_parent(parent_pid)
    worker: Worker | None = None
    stop_requested = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        if not stop_requested:
            logging.getLogger("taskq.worker").info("SIGTERM: stopping (finishing in-flight tasks)")
        stop_requested = True
        if worker is not None:
            worker.stop()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by the supervisor while starting us
    if setup is not None:
        setup()
    try:
        handlers = load(handlers_path)
        worker = Worker(
            handlers,
            settings,
            replace(
                config,
                worker_id=default_worker_id(),
                forwarder=config.forwarder and index == 0,
                relay=config.relay and index == 0,
                periodic=config.periodic and index == 0,
                metrics_port=None,  # the supervisor serves every process's metrics
            ),
        )
        if stop_requested:
            return
        logging.getLogger("taskq.worker").info(
            "worker %s: process %d of supervisor %d, %d handler(s), group %s%s%s",
            worker.worker_id,
            index,
            parent_pid,
            len(handlers),
            worker.group,
            ", with the delay forwarder" if worker.config.forwarder else "",
            ", with the outbox relay" if worker.config.relay else "",
        )
        worker.run()
    except (ConfigurationError, KafkaAuthenticationError) as exc:
        logging.getLogger("taskq.worker").error("worker process %d: %s", index, exc)
        refusals.put(f"worker process {index}: {exc}")
        sys.exit(REFUSED)
    except (TaskqError, SchemaError) as exc:
        # Like the command line: the project's own errors in one line; anything else keeps its traceback.
        logging.getLogger("taskq.worker").error("worker process %d: %s", index, exc)
        sys.exit(2)
