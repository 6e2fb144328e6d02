"""The bench's task handlers, by name, and the table their effects are written to: named here, apart from
the runs' set-up in `run`, because a spawned bench worker builds its handler from them and should import
what a deployed worker imports, not the benches' admin client and statistics."""

from __future__ import annotations

from typing import Literal

BenchHandler = Literal["noop", "plain", "transactional"]
BENCH_HANDLERS: tuple[BenchHandler, ...] = ("noop", "plain", "transactional")

#: The effects of the plain and transactional handlers: one row per idempotency key.
EFFECTS_TABLE = "bench_effects"
