"""The project's errors under one root, TaskqError; each class docstring is its default message."""

from __future__ import annotations


class TaskqError(Exception):
    """A task queue operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(TaskqError, ValueError):
    """A setting or argument is invalid; the message names it and the limit it broke."""


class UnknownTaskTypeError(TaskqError, LookupError):
    """No schema is registered for this task type and none was given to the producer."""


class InvalidPriorityError(TaskqError, ValueError):
    """The priority is not one of critical, high, normal, low."""


class InvalidTaskError(TaskqError, ValueError):
    """An enqueue argument (delay, timeout, max_attempts, keys) is invalid."""


class PayloadTooLargeError(TaskqError, ValueError):
    """The encoded payload is larger than the producer's limit."""


class QueueFullError(TaskqError):
    """A priority tier is over its depth limit; the task was not enqueued."""

    def __init__(self, priority: str, depth: int, limit: int) -> None:
        super().__init__(
            f"tier {priority!r} holds {depth} unprocessed tasks, over its depth limit of {limit}; "
            "the task was not enqueued (retry later or raise the limit)"
        )
        self.priority = priority
        self.depth = depth
        self.limit = limit


class RateLimitedError(TaskqError):
    """A rate limit is exhausted; the task was not enqueued."""

    def __init__(self, bucket: str, retry_after: float) -> None:
        super().__init__(
            f"rate limit {bucket!r} is exhausted; the task was not enqueued, retry after {retry_after:.3f}s"
        )
        self.bucket = bucket
        self.retry_after = retry_after


class DeliveryError(TaskqError):
    """The broker did not acknowledge one or more tasks."""

    def __init__(self, message: str | None = None, *, failures: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        #: (task id, error) for each task the broker did not take.
        self.failures = failures or []


class KafkaUnavailableError(TaskqError):
    """Kafka could not be reached or refused the operation."""


class KafkaAuthenticationError(KafkaUnavailableError):
    """Kafka refused the client's credentials or TLS handshake: the TASKQ_KAFKA_* settings need fixing."""


class RecordTooLargeError(KafkaUnavailableError):
    """The record is larger than the producer or the topic accepts; it cannot be sent as it is."""


class StoreUnavailableError(TaskqError):
    """Postgres could not be reached or failed the statement."""


class ProducerClosedError(TaskqError):
    """The producer is closed."""


class ResultError(TaskqError):
    """The handler's return value cannot be stored as its result: not JSON, or over the size limit."""


class TaskFailed(TaskqError):
    """The task was dead-lettered: it will not complete unless its DLQ record is replayed."""

    def __init__(
        self,
        task_id: str,
        reason: str,
        *,
        dlq_topic: str | None = None,
        dlq_partition: int | None = None,
        dlq_offset: int | None = None,
    ) -> None:
        where = (
            f"; its DLQ record is {dlq_topic}[{dlq_partition}]@{dlq_offset}" if dlq_offset is not None else ""
        )
        super().__init__(f"task {task_id} was dead-lettered: {reason}{where}")
        self.task_id = task_id
        #: Why it was dead-lettered (the DLQ record's reason).
        self.reason = reason
        self.dlq_topic = dlq_topic
        self.dlq_partition = dlq_partition
        self.dlq_offset = dlq_offset


class TaskCancelled(TaskqError):
    """The task was cancelled before it completed; it has no result."""


class NotCancellableError(TaskqError):
    """The task has finished already; there is nothing left to cancel."""

    def __init__(self, what: str, state: str) -> None:
        super().__init__(f"{what} is {state} already; there is nothing left to cancel")
        self.state = state
