"""The executor: thread, async and process attempts, timeouts, crashes, slots and shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import executor_handlers
import pytest

from taskq.consumer.executor import (
    Executor,
    Job,
    Outcome,
    TaskCrashed,
    TaskFailed,
    TaskTimeout,
    bound_traceback,
)
from taskq.consumer.executor._watchdog import Watchdog
from taskq.consumer.handlers import Handlers, HandlerSpec, TaskContext

HANDLERS_PATH = f"{executor_handlers.__name__}:handlers"
WAIT = 30.0


class Done:
    """An on_done that records every call and lets the test wait for the first."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.event = threading.Event()

    def __call__(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.event.set()

    def wait(self) -> Outcome:
        assert self.event.wait(WAIT), "no outcome reported"
        return self.outcomes[0]


def ctx_for(task_type: str, task_id: str = "t-1") -> TaskContext:
    return TaskContext(
        task_id=task_id,
        task_type=task_type,
        attempt=1,
        max_attempts=3,
        idempotency_key=f"key:{task_id}",
        priority="normal",
        headers={"h": b"v"},
        logger=logging.getLogger("taskq.task"),
    )


def job(spec: HandlerSpec, payload: Any = None, *, timeout: float | None = None, **kw: Any) -> Job:
    return Job(spec=spec, payload=payload, ctx=ctx_for(spec.task_type), timeout=timeout, **kw)


def spec_of(fn: Callable[..., Any], task_type: str = "t.Task") -> HandlerSpec:
    h = Handlers()
    h.task(task_type)(fn)
    spec = h.get(task_type)
    assert spec is not None
    return spec


def process_spec(task_type: str) -> HandlerSpec:
    spec = executor_handlers.handlers.get(task_type)
    assert spec is not None
    return spec


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # an orphan that init has not reaped yet is a zombie: dead all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.fixture
def ex() -> Iterator[Executor]:
    executor = Executor(concurrency=2)
    yield executor
    executor.shutdown(5)


@pytest.fixture(scope="module")
def pex() -> Iterator[Executor]:
    """One process executor for the module: children are reused across tests, as in a worker."""
    executor = Executor(concurrency=2, handlers_path=HANDLERS_PATH)
    yield executor
    executor.shutdown(10)


# -- thread mode ------------------------------------------------------------------------------------------


def test_thread_ok_returns_result_and_sets_deadline(ex: Executor) -> None:
    seen: list[float | None] = []

    def handler(payload: Any, ctx: TaskContext) -> Any:
        seen.append(ctx.deadline)
        return {"got": payload, "thread": threading.current_thread().name}

    done = Done()
    ex.submit(job(spec_of(handler), {"a": 1}, timeout=30), done)
    outcome = done.wait()
    assert outcome.ok and outcome.error is None
    assert outcome.result == {"got": {"a": 1}, "thread": "taskq-executor"}
    assert seen[0] is not None and seen[0] > time.monotonic()


def test_thread_exception_is_reported_with_traceback(ex: Executor) -> None:
    def failing_handler(payload: Any, ctx: TaskContext) -> None:
        raise ValueError("no such account")

    done = Done()
    ex.submit(job(spec_of(failing_handler)), done)
    outcome = done.wait()
    assert not outcome.ok and not outcome.timed_out and not outcome.crashed
    assert isinstance(outcome.error, ValueError)
    assert outcome.error_type == "builtins.ValueError"
    assert outcome.message == "no such account"
    assert "failing_handler" in outcome.traceback and "ValueError: no such account" in outcome.traceback


def test_thread_system_exit_is_a_failed_attempt_and_the_pool_survives(ex: Executor) -> None:
    def handler(payload: Any, ctx: TaskContext) -> Any:
        if payload == "exit":
            raise SystemExit(2)
        return "fine"

    spec = spec_of(handler)
    done = Done()
    ex.submit(job(spec, "exit"), done)
    outcome = done.wait()
    assert not outcome.ok and outcome.error_type == "builtins.SystemExit"
    for _ in range(3):  # more attempts than pool threads: none of them died
        again = Done()
        ex.submit(job(spec, "ok"), again)
        assert again.wait().result == "fine"


def test_thread_timeout_is_reported_at_deadline_and_thread_keeps_its_slot(ex: Executor) -> None:
    release, returned = threading.Event(), threading.Event()

    def handler(payload: Any, ctx: TaskContext) -> str:
        release.wait(WAIT)
        returned.set()
        return "late"

    done = Done()
    ex.submit(job(spec_of(handler), timeout=0.2), done)
    outcome = done.wait()
    try:
        assert outcome.timed_out and not outcome.ok
        assert isinstance(outcome.error, TaskTimeout)
        assert outcome.error_type == "taskq.consumer.executor.TaskTimeout"
        assert outcome.message == "timed out after 0.2 s"
        assert not returned.is_set()  # reported while the handler still runs
        assert ex.running() == 1 and ex.free_slots() == 1
    finally:
        release.set()
    assert returned.wait(WAIT)
    wait_until(lambda: ex.free_slots() == 2)
    ex.shutdown(5)  # joins the pool threads: a late second on_done would have happened by now
    assert len(done.outcomes) == 1


def test_the_watchdog_thread_is_woken_only_by_a_timer_that_comes_first() -> None:
    # Each attempt with a timeout schedules its deadline, almost never the earliest one: waking the
    # watchdog's thread for it would be a thread switch a task for nothing.
    wakes: list[int] = []

    class Counting(threading.Condition):
        def notify(self, n: int = 1) -> None:
            wakes.append(n)
            super().notify(n)

    dog = Watchdog()
    dog._cond = Counting()
    fired: list[str] = []
    soon = threading.Event()
    now = time.monotonic()
    try:
        later = [dog.schedule(now + 60 + i, lambda: fired.append("late")) for i in range(10)]
        assert wakes == []  # the first starts the thread; the others come after it
        dog.schedule(now + 0.05, soon.set)
        assert len(wakes) == 1
        assert soon.wait(WAIT), "the earlier timer did not fire"
        for timer in later:
            dog.cancel(timer)
    finally:
        dog.close(WAIT)
    assert fired == []


def test_job_call_is_run_instead_of_the_handler(ex: Executor) -> None:
    def handler(payload: Any, ctx: TaskContext) -> str:
        return "handler"

    done = Done()
    ex.submit(job(spec_of(handler), call=lambda: "wrapped"), done)
    assert done.wait().result == "wrapped"


def test_on_done_failure_is_logged_not_propagated(ex: Executor, caplog: pytest.LogCaptureFixture) -> None:
    spec = spec_of(lambda payload, ctx: payload)

    def bad_on_done(outcome: Outcome) -> None:
        raise RuntimeError("worker bug")

    with caplog.at_level(logging.ERROR, logger="taskq.executor"):
        ex.submit(job(spec, 1), bad_on_done)
        done = Done()
        ex.submit(job(spec, 2), done)
        assert done.wait().result == 2
        wait_until(lambda: "on_done failed" in caplog.text)


def test_concurrency_is_honoured() -> None:
    executor = Executor(concurrency=2)
    lock = threading.Lock()
    gate = threading.Event()
    now = peak = 0
    two_running = threading.Event()

    def handler(payload: Any, ctx: TaskContext) -> None:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
            if now == 2:
                two_running.set()
        gate.wait(WAIT)
        with lock:
            now -= 1

    spec = spec_of(handler)
    dones = [Done() for _ in range(4)]
    try:
        for i, done in enumerate(dones):
            executor.submit(job(spec, i), done)
        assert two_running.wait(WAIT)
        assert executor.free_slots() == 0
    finally:
        gate.set()
    for done in dones:
        assert done.wait().ok
    assert peak == 2
    wait_until(lambda: executor.free_slots() == 2)
    executor.shutdown(5)


def test_shutdown_returns_despite_a_stuck_thread_and_reports_it() -> None:
    executor = Executor(concurrency=1)
    stuck, started = threading.Event(), threading.Event()

    def handler(payload: Any, ctx: TaskContext) -> None:
        started.set()
        stuck.wait(WAIT)

    done = Done()
    executor.submit(job(spec_of(handler)), done)
    assert started.wait(WAIT)
    try:
        closer = threading.Thread(target=executor.shutdown, args=(0.2,))
        closer.start()
        closer.join(WAIT)
        assert not closer.is_alive()
        outcome = done.wait()
        assert outcome.timed_out and "shut down" in outcome.message
        with pytest.raises(RuntimeError):
            executor.submit(job(spec_of(handler)), Done())
    finally:
        stuck.set()


# -- async mode -------------------------------------------------------------------------------------------


def test_async_ok(ex: Executor) -> None:
    async def handler(payload: Any, ctx: TaskContext) -> Any:
        await asyncio.sleep(0)
        return payload * 2

    done = Done()
    ex.submit(job(spec_of(handler), 21, timeout=30), done)
    outcome = done.wait()
    assert outcome.ok and outcome.result == 42
    wait_until(lambda: ex.free_slots() == 2)


def test_async_exception(ex: Executor) -> None:
    async def handler(payload: Any, ctx: TaskContext) -> None:
        raise KeyError("missing")

    done = Done()
    ex.submit(job(spec_of(handler)), done)
    outcome = done.wait()
    assert not outcome.ok and isinstance(outcome.error, KeyError)
    assert outcome.error_type == "builtins.KeyError" and "handler" in outcome.traceback


def test_async_timeout_cancels_the_coroutine(ex: Executor) -> None:
    cancelled = threading.Event()

    async def handler(payload: Any, ctx: TaskContext) -> None:
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    done = Done()
    ex.submit(job(spec_of(handler), timeout=0.2), done)
    outcome = done.wait()
    assert outcome.timed_out and isinstance(outcome.error, TaskTimeout)
    assert cancelled.wait(WAIT)
    wait_until(lambda: ex.free_slots() == 2)
    assert len(done.outcomes) == 1


# -- process mode -----------------------------------------------------------------------------------------


def test_process_ok_runs_in_a_reused_child(pex: Executor) -> None:
    pids = []
    for i in range(2):
        done = Done()
        pex.submit(job(process_spec("x.Ok"), {"n": i}, timeout=30), done)
        outcome = done.wait()
        assert outcome.ok, outcome
        assert outcome.result["echo"] == {"n": i} and outcome.result["task_id"] == "t-1"
        assert outcome.result["has_deadline"]
        pids.append(outcome.result["pid"])
    assert pids[0] != os.getpid()
    assert pids[0] == pids[1]  # one task at a time: the idle child is reused, not respawned


def test_a_process_isolated_workflow_step_gets_the_results_before_it(pex: Executor) -> None:
    # Read in the worker (where Postgres is) and sent with the job: the child has no store to ask.
    done = Done()
    step = job(process_spec("x.Ok"), {"n": 1}, timeout=30)
    members = [{"task_id": "m1", "state": "completed", "result": 2, "error": None}]
    step.ctx.workflow_inputs = lambda: ({"total": 3}, members)
    pex.submit(step, done)
    outcome = done.wait()
    assert outcome.ok, outcome
    assert outcome.result["parent_result"] == {"total": 3}
    assert outcome.result["group_results"] == members


def test_process_exception_becomes_task_failed(pex: Executor) -> None:
    done = Done()
    pex.submit(job(process_spec("x.Raises"), 7), done)
    outcome = done.wait()
    assert not outcome.ok and not outcome.crashed
    assert isinstance(outcome.error, TaskFailed)
    assert outcome.error_type == outcome.error.error_type == "builtins.ValueError"
    assert outcome.message == "bad payload 7"
    assert "raises" in outcome.traceback and "ValueError: bad payload 7" in outcome.traceback
    assert isinstance(outcome.error.__cause__, ValueError)  # for retry policies matching on class


def test_process_system_exit_is_a_failed_attempt_and_the_child_survives(pex: Executor) -> None:
    first = Done()
    pex.submit(job(process_spec("x.Ok")), first)
    pid = first.wait().result["pid"]
    done = Done()
    pex.submit(job(process_spec("x.SystemExit")), done)
    outcome = done.wait()
    assert not outcome.ok and not outcome.crashed and outcome.error_type == "builtins.SystemExit"
    again = Done()
    pex.submit(job(process_spec("x.Ok")), again)
    assert again.wait().result["pid"] == pid


def test_process_timeout_kills_the_child(pex: Executor, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    done = Done()
    pex.submit(job(process_spec("x.Sleeps"), {"pid_file": str(pid_file)}, timeout=1.0), done)
    outcome = done.wait()
    assert outcome.timed_out and not outcome.crashed and isinstance(outcome.error, TaskTimeout)
    pid = int(pid_file.read_text())
    assert pid != os.getpid()
    with pytest.raises(ProcessLookupError):  # killed and reaped before the timeout was reported
        os.kill(pid, 0)
    again = Done()
    pex.submit(job(process_spec("x.Ok")), again)
    assert again.wait().ok


def test_process_exit_is_a_crash_and_the_executor_carries_on(pex: Executor) -> None:
    done = Done()
    pex.submit(job(process_spec("x.Exit")), done)
    outcome = done.wait()
    assert outcome.crashed and not outcome.ok and not outcome.timed_out
    assert isinstance(outcome.error, TaskCrashed)
    assert outcome.message == "worker process died: exit code 3"
    again = Done()
    pex.submit(job(process_spec("x.Ok")), again)
    assert again.wait().ok
    assert pex.free_slots() == 2


def test_process_segfault_is_a_crash(pex: Executor) -> None:
    done = Done()
    pex.submit(job(process_spec("x.Segfault")), done)
    outcome = done.wait()
    assert outcome.crashed and outcome.message == "killed by signal SIGSEGV"
    assert outcome.error_type == "taskq.consumer.executor.TaskCrashed"


def test_process_unpicklable_result_is_an_error(pex: Executor) -> None:
    done = Done()
    pex.submit(job(process_spec("x.Unpicklable")), done)
    outcome = done.wait()
    assert not outcome.ok and not outcome.crashed and isinstance(outcome.error, TaskFailed)
    assert "x.Unpicklable cannot be pickled" in outcome.message and "lock" in outcome.message


def test_process_unknown_task_type_in_the_handlers_module() -> None:
    h = Handlers()
    h.task("x.NotThere", isolation="process")(lambda payload, ctx: None)
    spec = h.get("x.NotThere")
    assert spec is not None
    executor = Executor(concurrency=1, handlers_path=HANDLERS_PATH)
    try:
        done = Done()
        executor.submit(job(spec), done)
        outcome = done.wait()
        assert not outcome.ok and outcome.error_type == "builtins.LookupError"
        assert "no handler for 'x.NotThere'" in outcome.message
    finally:
        executor.shutdown(10)


def test_bad_handlers_path_is_a_clear_error() -> None:
    executor = Executor(concurrency=1, handlers_path="no_such_module_xyz:handlers")
    try:
        done = Done()
        executor.submit(job(process_spec("x.Ok")), done)
        outcome = done.wait()
        assert not outcome.ok and not outcome.timed_out
        assert outcome.error_type == "taskq._core.errors.ConfigurationError"
        assert "cannot load handlers 'no_such_module_xyz:handlers'" in outcome.message
        assert "No module named 'no_such_module_xyz'" in outcome.message
        assert executor.free_slots() == 1
    finally:
        executor.shutdown(10)


def test_process_job_needs_handlers_path(ex: Executor) -> None:
    with pytest.raises(ValueError, match="handlers_path"):
        ex.submit(job(process_spec("x.Ok")), Done())
    assert ex.free_slots() == 2


def test_shutdown_kills_running_and_idle_children(tmp_path: Path) -> None:
    executor = Executor(concurrency=2, handlers_path=HANDLERS_PATH)
    idle = Done()
    executor.submit(job(process_spec("x.Ok")), idle)
    idle_pid = idle.wait().result["pid"]
    pid_file = tmp_path / "pid"
    done = Done()
    executor.submit(job(process_spec("x.Sleeps"), {"pid_file": str(pid_file)}), done)
    wait_until(lambda: pid_file.exists() and pid_file.read_text())  # created, then written
    executor.shutdown(0.2)
    outcome = done.wait()
    assert outcome.timed_out and "shut down" in outcome.message
    for pid in (idle_pid, int(pid_file.read_text())):
        wait_until(lambda pid=pid: gone(pid))


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = f"""
import os, signal, sys, threading, logging
from taskq.consumer.executor import Executor, Job
from taskq.consumer.handlers import TaskContext
import executor_handlers
ex = Executor(concurrency=1, handlers_path="executor_handlers:handlers")
ctx = TaskContext(task_id="1", task_type="x.Sleeps", attempt=1, max_attempts=1, idempotency_key="k",
                  priority="normal", headers={{}}, logger=logging.getLogger("t"))
ex.submit(Job(spec=executor_handlers.handlers.get("x.Sleeps"), payload={{"pid_file": {str(pid_file)!r}}},
              ctx=ctx, timeout=None), print)
while not os.path.exists({str(pid_file)!r}):
    threading.Event().wait(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL
    pid = int(pid_file.read_text())
    wait_until(lambda: gone(pid))


# -- pieces -----------------------------------------------------------------------------------------------


def test_traceback_keeps_the_last_8_kib() -> None:
    text = "a" * 10_000 + "é" * 3000 + "END"
    cut = bound_traceback(text)
    assert len(cut.encode()) <= 8 * 1024
    assert cut.endswith("END") and cut.startswith("...(traceback truncated)")
    assert bound_traceback("short") == "short"


def test_an_error_text_utf8_cannot_encode_is_reported_with_escapes(ex: Executor) -> None:
    # A lone surrogate (bytes decoded with surrogateescape) cannot go to Postgres or a Kafka header.
    name = b"report-\xff.pdf".decode("utf-8", "surrogateescape")

    def handler(payload: Any, ctx: TaskContext) -> None:
        raise OSError(f"cannot open {name}")

    done = Done()
    ex.submit(job(spec_of(handler)), done)
    outcome = done.wait()
    assert outcome.message == "cannot open report-\\udcff.pdf"
    assert "OSError: cannot open report-\\udcff.pdf" in outcome.traceback
    outcome.traceback.encode("utf-8")


def test_invalid_concurrency_is_rejected() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Executor(concurrency=0)


def test_task_failed_survives_pickling() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(TaskFailed("builtins.ValueError", "bad", "Traceback ...")))
    assert (error.error_type, error.message, error.traceback) == (
        "builtins.ValueError",
        "bad",
        "Traceback ...",
    )
    assert str(error) == "builtins.ValueError: bad"


def test_a_child_process_loads_the_handlers_not_the_worker_loop_or_its_drivers(pex: Executor) -> None:
    done = Done()
    pex.submit(job(process_spec("x.Modules"), timeout=30), done)
    outcome = done.wait()
    assert outcome.ok, outcome.message
    loaded = set(outcome.result)
    assert "taskq.consumer.handlers" in loaded  # it did run in a child that loaded the handlers
    for module in ("taskq.consumer.worker", "taskq.cli", "psycopg", "confluent_kafka", "prometheus_client"):
        assert module not in loaded, f"a handler's child imported {module}: {sorted(loaded)}"


def test_prepared_pool_threads_each_run_the_preparation_once_and_go_on_if_it_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ex = Executor(concurrency=3)
    seen: list[str] = []
    lock = threading.Lock()

    def prepare() -> None:
        with lock:
            seen.append(threading.current_thread().name + str(threading.get_ident()))
            if len(seen) == 2:
                raise RuntimeError("no connection")

    try:
        assert ex.prepare_threads(prepare).wait(WAIT)
        assert len(set(seen)) == 3  # once on each of the three threads
        assert "preparing a pool thread failed" in caplog.text
        started = threading.Barrier(3, timeout=WAIT)  # three attempts at once: each on a thread of its own
        done = [Done() for _ in range(3)]
        for d in done:
            ex.submit(job(spec_of(lambda payload, ctx: started.wait())), d)
        assert all(d.wait().ok for d in done)
    finally:
        ex.shutdown(WAIT)
