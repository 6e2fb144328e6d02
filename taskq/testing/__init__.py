"""Fakes for tests, yours and ours: an in-memory broker, idempotency store and schema registry with the real
ones' semantics, and `InMemoryQueue`, which runs a `Handlers` registry over them with no services.

```python
from taskq.testing import InMemoryQueue

q = InMemoryQueue(handlers)                      # the app's taskq.Handlers
q.producer.enqueue("demo.SendEmail", {...}, idempotency_key="k")
q.run_until_idle()                               # runs what is due, retries included; delays fast-forwarded
q.completed, q.dead_letters                      # what happened, to assert on
```

The fakes keep the rules that matter to correctness: partitions with offsets, committed offsets per group,
pause and seek, range assignment over a group's members with revocation before reassignment, transactions
whose records and offsets commit together; claims with leases, attempts counted at claim time, completion
only by the lease holder's current attempt; BACKWARD compatibility of schema versions. One contract suite
(`tests/contract`) runs the same tests against these and against the real services, so they cannot drift.
"""

from __future__ import annotations

from taskq.testing.broker import InMemoryBroker
from taskq.testing.clock import Clock
from taskq.testing.queue import InMemoryQueue
from taskq.testing.recording import RecordingHook
from taskq.testing.registry import InMemoryRegistry
from taskq.testing.store import InMemoryStore

__all__ = [
    "Clock",
    "InMemoryBroker",
    "InMemoryQueue",
    "InMemoryRegistry",
    "InMemoryStore",
    "RecordingHook",
]
