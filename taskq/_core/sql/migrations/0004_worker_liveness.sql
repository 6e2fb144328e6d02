-- Liveness records: one row per running worker, written at its start and on every heartbeat (a thread of
-- its own), removed on a clean stop. A claim takes over at once the keys leased by a worker whose heartbeat
-- is stale or that was marked dead (a worker that starts marks dead the earlier workers of its host whose
-- process is gone), instead of waiting out their leases (invariant 9).
CREATE TABLE IF NOT EXISTS taskq_workers (
    worker_id     text PRIMARY KEY,  -- the lease owner id of its claims
    namespace     text NOT NULL,
    worker_group  text NOT NULL,
    host          text NOT NULL,
    pid           integer NOT NULL,
    concurrency   integer NOT NULL,
    in_flight     integer NOT NULL DEFAULT 0,
    started_at    timestamptz NOT NULL,
    heartbeat_at  timestamptz NOT NULL,
    dead_at       timestamptz  -- set by a successor on the same host that found the process gone
);

-- Runs taken over from a dead worker: they count here, not in attempts (the poison-pill rule reads them).
ALTER TABLE taskq_tasks ADD COLUMN interruptions integer NOT NULL DEFAULT 0;
