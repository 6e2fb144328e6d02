-- Idempotency records: one row per idempotency key, the unit of "an effect happens once".
CREATE TABLE IF NOT EXISTS taskq_tasks (
    idempotency_key  text PRIMARY KEY,
    task_id          text NOT NULL,
    task_type        text NOT NULL,
    -- running: leased by lease_owner until lease_expires_at; failed: last attempt failed, retryable;
    -- completed: the effect happened (terminal); dead: dead-lettered (replay may revive it).
    state            text NOT NULL CHECK (state IN ('running', 'failed', 'completed', 'dead')),
    attempts         integer NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    last_error       text,
    result           jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz
);
CREATE INDEX IF NOT EXISTS taskq_tasks_updated_at ON taskq_tasks (updated_at);

-- Shared token buckets of producer rate limits: one row per bucket.
CREATE TABLE IF NOT EXISTS taskq_rate_buckets (
    name         text PRIMARY KEY,
    rate         double precision NOT NULL,
    capacity     double precision NOT NULL,
    tokens       double precision NOT NULL,
    last_granted double precision NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL
);
