"""The producer library: enqueue typed, schema-validated tasks onto priority topics."""

from taskq._core.envelope import PRIORITIES, Envelope, Priority, Topics
from taskq._core.errors import (
    DeliveryError,
    InvalidPriorityError,
    InvalidTaskError,
    KafkaUnavailableError,
    PayloadTooLargeError,
    ProducerClosedError,
    QueueFullError,
    RateLimitedError,
    StoreUnavailableError,
    TaskqError,
    UnknownTaskTypeError,
)
from taskq._core.settings import Settings
from taskq.producer.producer import Receipt, TaskProducer, TaskSpec, derive_idempotency_key
from taskq.producer.ratelimit import RateLimit
from taskq.schemas.errors import PayloadValidationError

__all__ = [
    "PRIORITIES",
    "DeliveryError",
    "Envelope",
    "InvalidPriorityError",
    "InvalidTaskError",
    "KafkaUnavailableError",
    "PayloadTooLargeError",
    "PayloadValidationError",
    "Priority",
    "ProducerClosedError",
    "QueueFullError",
    "RateLimit",
    "RateLimitedError",
    "Receipt",
    "Settings",
    "StoreUnavailableError",
    "TaskProducer",
    "TaskSpec",
    "TaskqError",
    "Topics",
    "UnknownTaskTypeError",
    "derive_idempotency_key",
]
