"""A worker's signal handling in a process of its own: the loop's waits must not outlive a signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.conftest import REPO

# A worker on the fakes, in the main thread as `taskq worker` runs it, with one long task in flight and a
# log handler that takes 0.2 s over the shutdown line (as a busy machine's logging may).
_WORKER = """
import logging, os, sys, time
from taskq import Handlers, TaskContext
from taskq._core.settings import Settings
from taskq.consumer.worker import Worker, WorkerConfig
from taskq.producer.admin import topic_specs
from taskq.producer.producer import TaskProducer
from taskq.testing import InMemoryBroker, InMemoryRegistry, InMemoryStore

class Slow(logging.Handler):
    def emit(self, record):
        if "stopping" in record.getMessage():
            time.sleep(0.2)

logging.getLogger("taskq").addHandler(Slow())
logging.getLogger("taskq").setLevel(logging.INFO)
JOB = {"type": "record", "name": "Job", "namespace": "unit", "fields": [{"name": "n", "type": "long"}]}
handlers = Handlers()

@handlers.task("unit.Job", schema=JOB)
def job(payload, ctx: TaskContext) -> None:
    print("started", flush=True)
    time.sleep(60)

settings = Settings(namespace="unit")
broker = InMemoryBroker()
broker.admin().create_topics(topic_specs(settings, partitions=1))
registry = InMemoryRegistry()
registry.register(JOB)
producer = TaskProducer(settings, registry=registry, broker=broker)
producer.enqueue("unit.Job", {"n": 0})
producer.flush()
worker = Worker(
    handlers,
    settings,
    WorkerConfig(worker_id="w", forwarder=False, concurrency=1, shutdown_timeout=0.5),
    broker=broker,
    store=InMemoryStore(owner="w"),
    registry=registry,
)
worker.install_signal_handlers()
worker.run()
print("stopped", flush=True)
os._exit(0)
"""


def test_a_signal_whose_handler_outlasts_the_loops_wait_still_stops_the_worker() -> None:
    # CPython 3.11's SimpleQueue.get(timeout=...) waits for ever once a signal handler has run past the
    # timeout (it then waits with a negative one). The loop waits so for its tasks' outcomes, up to 50 ms a
    # pass: a SIGTERM whose handler logged for longer left a worker with a long task waiting for that task,
    # or with none for ever ("did not exit within 60s" in CI).
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.5)  # the loop waits for the running task's outcome, 50 ms at a time
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert "stopped" in out, out
