"""The worker runtime: run handlers of typed tasks from Kafka, each effect once, with retries and a DLQ."""

from consumer.handlers import Handlers, TaskContext
from consumer.retry import Reject, Retry, RetryPolicy
from consumer.worker import Worker, WorkerConfig

__all__ = ["Handlers", "Reject", "Retry", "RetryPolicy", "TaskContext", "Worker", "WorkerConfig"]
