"""Services a worker runs beside its loop (the delay forwarder, the outbox relay, the periodic scheduler)."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from taskq._core.errors import KafkaAuthenticationError


class Service(Protocol):
    """Something that runs until stopped."""

    def run(self) -> None: ...
    def stop(self) -> None: ...


class ServiceThread(threading.Thread):
    """The daemon thread a service runs on; `error` is what stopped it, if it stopped by raising."""

    error: BaseException | None = None


def run_in_thread(service: Service, name: str) -> ServiceThread:
    """Start a service on a daemon thread named taskq-`name`, as `taskq worker` runs it. Refused Kafka
    credentials stop it with one line on the taskq.`name` logger: the worker's own clients meet the same
    refusal and end the process. Whatever stopped it is kept as the thread's `error` (the worker checks)."""

    def run() -> None:
        try:
            service.run()
        except KafkaAuthenticationError as exc:
            thread.error = exc
            logging.getLogger(f"taskq.{name}").error("%s stopped: %s", name, exc)
        except BaseException as exc:
            thread.error = exc
            logging.getLogger(f"taskq.{name}").exception("%s stopped", name)

    thread = ServiceThread(target=run, name=f"taskq-{name}", daemon=True)
    thread.start()
    return thread
