"""The producer library: enqueue typed, schema-validated tasks onto priority topics."""

from producer.config import Settings
from producer.envelope import PRIORITIES, Envelope, Priority, Topics
from producer.errors import (
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
from producer.producer import Receipt, TaskProducer, TaskSpec, derive_idempotency_key
from producer.ratelimit import RateLimit
from schemas.errors import PayloadValidationError

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
