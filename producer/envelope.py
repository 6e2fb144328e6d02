"""The task envelope: what travels in Kafka headers beside an Avro payload, and the tier vocabulary."""

from __future__ import annotations

from typing import Final, Literal, get_args

Priority = Literal["critical", "high", "normal", "low"]
#: Priority tiers, highest first. The order is the dispatch preference of workers.
PRIORITIES: Final[tuple[Priority, ...]] = get_args(Priority)
#: Default weights of the worker's weighted round-robin, in PRIORITIES order.
DEFAULT_WEIGHTS: Final[dict[Priority, int]] = {"critical": 8, "high": 4, "normal": 2, "low": 1}
