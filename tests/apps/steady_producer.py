"""A producer process for the acceptance tests: Ledger tasks at a steady pace until told to stop.

    python -m tests.apps.steady_producer STOP_FILE RATE

Enqueues keys steady-0, steady-1, ... (one task each, spread over the tiers; every fourth delayed by a
second, so the workers' forwarders move it in Kafka transactions) at RATE tasks a second until STOP_FILE
exists, then waits for every acknowledgement and prints `enqueued N`. A task the broker refused raises
(exit 1): nothing the test counts on was left unsent.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from taskq import TaskProducer
from taskq._core.envelope import PRIORITIES
from tests.apps.app import NS


def main(stop: Path, rate: float) -> int:
    """Enqueue until `stop` exists; print how many."""
    n = 0
    with TaskProducer.from_env() as producer:
        started = time.monotonic()
        while not stop.exists():
            producer.enqueue(
                f"{NS}.Ledger",
                {"key": f"steady-{n}", "amount": n},
                idempotency_key=f"ledger:steady-{n}",
                priority=PRIORITIES[n % len(PRIORITIES)],
                delay=1 if n % 4 == 3 else None,
            )
            n += 1
            # The pace, not a wait for an event: task n leaves n / rate seconds after the first.
            time.sleep(max(0.0, started + n / rate - time.monotonic()))
        producer.flush(120)
    print(f"enqueued {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), float(sys.argv[2])))
