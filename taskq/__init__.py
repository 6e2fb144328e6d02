"""kafka-taskq: a distributed task queue on Apache Kafka, with each task's effect recorded once in Postgres.

The public API is what `__all__` lists. Names are imported on first use, so a service that only enqueues
loads no worker code, and a process-isolated handler's child loads only what it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from taskq._core.lazy import lazy_exports

__version__ = "0.2.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "AsyncTaskProducer": "taskq.producer.aio",
    "TaskProducer": "taskq.producer.producer",
    "TaskSpec": "taskq.producer.tasks",
    "Receipt": "taskq.producer.tasks",
    "TaskStatus": "taskq.producer.status",
    "chain": "taskq.producer.workflows",
    "group": "taskq.producer.workflows",
    "WorkflowReceipt": "taskq.producer.workflows",
    "WorkflowStatus": "taskq.producer.workflows",
    "TaskState": "taskq.producer.status",
    "derive_idempotency_key": "taskq.producer.tasks",
    "RateLimit": "taskq.producer.ratelimit",
    "Handlers": "taskq.consumer.handlers",
    "TaskContext": "taskq.consumer.handlers",
    "Retry": "taskq.consumer.retry",
    "Reject": "taskq.consumer.retry",
    "RetryPolicy": "taskq.consumer.retry",
    "Worker": "taskq.consumer.worker",
    "WorkerConfig": "taskq.consumer.worker",
    "DeadLetters": "taskq.consumer.dlq",
    "Settings": "taskq._core.settings",
    "PRIORITIES": "taskq._core.envelope",
    "Priority": "taskq._core.envelope",
    "TaskqError": "taskq._core.errors",
    "DeliveryError": "taskq._core.errors",
    "InvalidPriorityError": "taskq._core.errors",
    "InvalidTaskError": "taskq._core.errors",
    "KafkaUnavailableError": "taskq._core.errors",
    "PayloadTooLargeError": "taskq._core.errors",
    "ProducerClosedError": "taskq._core.errors",
    "QueueFullError": "taskq._core.errors",
    "RateLimitedError": "taskq._core.errors",
    "StoreUnavailableError": "taskq._core.errors",
    "UnknownTaskTypeError": "taskq._core.errors",
    "TaskFailed": "taskq._core.errors",
    "TaskCancelled": "taskq._core.errors",
    "NotCancellableError": "taskq._core.errors",
    "ResultError": "taskq._core.errors",
    "SchemaError": "taskq.schemas.errors",
    "PayloadValidationError": "taskq.schemas.errors",
}

__all__ = [
    "PRIORITIES",
    "AsyncTaskProducer",
    "DeadLetters",
    "DeliveryError",
    "Handlers",
    "InvalidPriorityError",
    "InvalidTaskError",
    "KafkaUnavailableError",
    "NotCancellableError",
    "PayloadTooLargeError",
    "PayloadValidationError",
    "Priority",
    "ProducerClosedError",
    "QueueFullError",
    "RateLimit",
    "RateLimitedError",
    "Receipt",
    "Reject",
    "ResultError",
    "Retry",
    "RetryPolicy",
    "SchemaError",
    "Settings",
    "StoreUnavailableError",
    "TaskCancelled",
    "TaskContext",
    "TaskFailed",
    "TaskProducer",
    "TaskSpec",
    "TaskState",
    "TaskStatus",
    "TaskqError",
    "UnknownTaskTypeError",
    "Worker",
    "WorkerConfig",
    "WorkflowReceipt",
    "WorkflowStatus",
    "__version__",
    "chain",
    "derive_idempotency_key",
    "group",
]

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports on demand
    from taskq._core.envelope import PRIORITIES, Priority
    from taskq._core.errors import (
        DeliveryError,
        InvalidPriorityError,
        InvalidTaskError,
        KafkaUnavailableError,
        NotCancellableError,
        PayloadTooLargeError,
        ProducerClosedError,
        QueueFullError,
        RateLimitedError,
        ResultError,
        StoreUnavailableError,
        TaskCancelled,
        TaskFailed,
        TaskqError,
        UnknownTaskTypeError,
    )
    from taskq._core.settings import Settings
    from taskq.consumer.dlq import DeadLetters
    from taskq.consumer.handlers import Handlers, TaskContext
    from taskq.consumer.retry import Reject, Retry, RetryPolicy
    from taskq.consumer.worker import Worker, WorkerConfig
    from taskq.producer.aio import AsyncTaskProducer
    from taskq.producer.producer import TaskProducer
    from taskq.producer.ratelimit import RateLimit
    from taskq.producer.status import TaskState, TaskStatus
    from taskq.producer.tasks import Receipt, TaskSpec, derive_idempotency_key
    from taskq.producer.workflows import WorkflowReceipt, WorkflowStatus, chain, group
    from taskq.schemas.errors import PayloadValidationError, SchemaError


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
