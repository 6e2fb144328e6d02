-- Concurrency slots: one row per running task of a task type with `concurrency_limit`, holding one of its
-- key's N slots. A worker takes slots under an advisory lock per (namespace, task type, key) and counts the
-- live ones: unexpired, and held by a worker whose liveness record is fresh. A dead worker's slots free when
-- its heartbeat goes stale (or its lease ends), and the next acquire of their key deletes them.
CREATE TABLE IF NOT EXISTS taskq_slots (
    namespace         text NOT NULL,
    idempotency_key   text NOT NULL,  -- the task holding the slot (one slot per task)
    task_type         text NOT NULL,
    slot_key          text NOT NULL,  -- what concurrency_key returned for the task's payload
    owner             text NOT NULL,  -- the worker id, as in taskq_tasks.lease_owner
    lease_expires_at  timestamptz NOT NULL,
    acquired_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (namespace, idempotency_key)
);
CREATE INDEX IF NOT EXISTS taskq_slots_key ON taskq_slots (namespace, task_type, slot_key);
