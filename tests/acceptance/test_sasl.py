"""Kafka through the stack's SASL_SSL listener (SCRAM-SHA-512 over TLS), configured by TASKQ_KAFKA_* only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable

import pytest

from taskq._core.errors import DeliveryError, KafkaAuthenticationError
from taskq._core.settings import Settings
from taskq.producer.aio import AsyncTaskProducer
from taskq.producer.producer import TaskProducer
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, all_committed, wait_until

#: What `compose/stack up` exports about its SASL_SSL listener.
STACK_SASL = (
    "TASKQ_STACK_SASL_BOOTSTRAP",
    "TASKQ_STACK_SASL_CA",
    "TASKQ_STACK_SASL_USERNAME",
    "TASKQ_STACK_SASL_PASSWORD",
)


@pytest.fixture
def secured(
    stack_env: dict[str, str], env_of: Callable[..., dict[str, str]]
) -> Callable[[str], dict[str, str]]:
    """A process environment that reaches Kafka only through the SASL_SSL listener, with this password."""
    facts = {name: os.environ.get(name, "") for name in STACK_SASL}
    if not all(facts.values()):
        if os.environ.get("TASKQ_TEST_STACK") == "containers":
            pytest.skip("the container stack has no SASL_SSL listener")
        pytest.fail(
            "compose/stack exported no SASL_SSL listener (TASKQ_STACK_SASL_*): it needs `openssl` on PATH, "
            "and a broker started before the listener existed needs `compose/stack restart kafka`"
        )

    def make(password: str) -> dict[str, str]:
        env = env_of(
            TASKQ_BOOTSTRAP_SERVERS=facts["TASKQ_STACK_SASL_BOOTSTRAP"],
            TASKQ_KAFKA_SECURITY_PROTOCOL="SASL_SSL",
            TASKQ_KAFKA_SASL_MECHANISM="SCRAM-SHA-512",
            TASKQ_KAFKA_SASL_USERNAME=facts["TASKQ_STACK_SASL_USERNAME"],
            TASKQ_KAFKA_SASL_PASSWORD=password,
            TASKQ_KAFKA_SSL_CA_LOCATION=facts["TASKQ_STACK_SASL_CA"],
        )
        for name in STACK_SASL:  # only the TASKQ_KAFKA_* settings tell the process how to connect
            env.pop(name, None)
        return env

    return make


def taskq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run `taskq ARGS...`; a command that hangs for a minute fails the test."""
    return subprocess.run(
        [sys.executable, "-m", "taskq.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_tasks_are_enqueued_and_worked_through_sasl_ssl(
    app: App, secured: Callable[[str], dict[str, str]]
) -> None:
    env = secured(os.environ["TASKQ_STACK_SASL_PASSWORD"])
    keys = ["s0", "s1", "s2"]
    for i, key in enumerate(keys):
        # The last one is delayed: the forwarder's transactional producer and its consumer go through
        # the listener too.
        delay = ("--delay", "1s") if i == len(keys) - 1 else ()
        payload = f'{{"key": "{key}", "amount": {i}}}'
        out = taskq(env, "enqueue", app.type("Ledger"), "--json", payload, "--idempotency-key", key, *delay)
        assert out.returncode == 0, out.stderr[-3000:]
    worker = WorkerProcess(env, app.tmp_path / "worker-sasl.log")
    app.workers.append(worker)
    wait_until(
        lambda: app.scalar("SELECT count(DISTINCT key) FROM ledger") == len(keys),
        timeout=90,
        what=f"the ledger effects of {keys}",
    )
    wait_until(lambda: all_committed(app.settings), timeout=60, what="the group to commit every offset")
    app.assert_once_each(keys)
    worker.terminate()
    assert worker.wait(60) == 0, worker.output()[-3000:]


def _refused_in_one_line(output: str, password: str) -> None:
    assert "Traceback" not in output, output[-3000:]
    assert password not in output, "the password was printed"
    errors = [line for line in output.splitlines() if line.startswith("taskq: error:")]
    assert len(errors) == 1, output[-3000:]
    assert "Kafka refused the connection" in errors[0] and "Authentication failed" in errors[0], errors[0]
    assert output.rstrip().splitlines()[-1] == errors[0], output[-3000:]


def test_a_wrong_password_fails_fast_in_one_line(app: App, secured: Callable[[str], dict[str, str]]) -> None:
    password = f"wrong-{uuid.uuid4().hex}"
    env = secured(password)

    out = taskq(env, "enqueue", app.type("Ledger"), "--json", '{"key": "w0", "amount": 0}')
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    _refused_in_one_line(out.stderr, password)

    worker = WorkerProcess(env, app.tmp_path / "worker-refused.log")
    app.workers.append(worker)
    assert worker.wait(60) == 2, worker.output()[-3000:]  # it stops by itself: no retrying for ever
    _refused_in_one_line(worker.output(), password)

    forwarder = WorkerProcess.command(env, app.tmp_path / "forwarder-refused.log", "forwarder")
    app.workers.append(forwarder)
    assert forwarder.wait(60) == 2, forwarder.output()[-3000:]
    _refused_in_one_line(forwarder.output(), password)

    with app.db.connect(autocommit=False) as conn:  # a task staged in the outbox, for the relay to publish
        app.producer.enqueue(app.type("Ledger"), {"key": "o0", "amount": 0}, conn=conn)
        conn.commit()
    relay = WorkerProcess.command(env, app.tmp_path / "relay-refused.log", "relay")
    app.workers.append(relay)
    assert relay.wait(60) == 2, relay.output()[-3000:]
    _refused_in_one_line(relay.output(), password)
    assert app.scalar("SELECT count(*) FROM taskq_outbox") == 1  # left for a relay that may publish it


def test_a_producer_with_a_wrong_password_raises_instead_of_waiting_out_delivery(
    app: App, secured: Callable[[str], dict[str, str]]
) -> None:
    producer = TaskProducer(Settings.from_env(secured(f"wrong-{uuid.uuid4().hex}")))
    producer.enqueue(app.type("Ledger"), {"key": "p0", "amount": 0})  # queued: nothing waits for the broker
    raised: list[BaseException] = []
    done = threading.Event()

    def flush() -> None:
        try:
            producer.flush()
        except Exception as exc:
            raised.append(exc)
        finally:
            done.set()

    threading.Thread(target=flush, daemon=True).start()
    # The delivery timeout is two minutes: the refusal must come long before it.
    assert done.wait(30), "flush() waited for the delivery timeout instead of raising the refusal"
    assert raised and isinstance(raised[0], KafkaAuthenticationError), raised
    with contextlib.suppress(KafkaAuthenticationError):
        producer.close()


def test_an_async_producer_with_a_wrong_password_raises_to_who_waits(
    app: App, secured: Callable[[str], dict[str, str]]
) -> None:
    producer = AsyncTaskProducer(Settings.from_env(secured(f"wrong-{uuid.uuid4().hex}")))

    async def enqueue_and_wait() -> None:
        with pytest.raises(KafkaAuthenticationError, match="Kafka refused the connection"):
            # The delivery timeout is two minutes: the refusal must come long before it.
            await asyncio.wait_for(
                producer.enqueue(app.type("Ledger"), {"key": "a0", "amount": 0}, wait=True), 30
            )
        with contextlib.suppress(KafkaAuthenticationError, DeliveryError):
            await producer.close(timeout=5)

    asyncio.run(enqueue_and_wait())


def test_a_supervisor_whose_workers_are_refused_gives_up_at_once(
    app: App, secured: Callable[[str], dict[str, str]]
) -> None:
    # Refused credentials do not heal by restarting: the supervisor stops on the first refusal instead of
    # restarting its processes five times over about 40 s, and says why in one line.
    password = f"wrong-{uuid.uuid4().hex}"
    supervisor = WorkerProcess(secured(password), app.tmp_path / "supervisor-refused.log", "--processes", "2")
    app.workers.append(supervisor)
    assert supervisor.wait(60) == 2, supervisor.output()[-3000:]
    output = supervisor.output()
    assert "restarting it" not in output, output[-3000:]
    assert len(re.findall(r"worker process \d started", output)) <= 2, output[-3000:]  # none restarted
    _refused_in_one_line(output, password)
