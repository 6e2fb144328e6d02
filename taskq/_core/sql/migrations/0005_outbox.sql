-- The transactional outbox: tasks enqueued through an application's own connection, inside its transaction,
-- wait here until a relay publishes them to Kafka and deletes them. A row is the task exactly as it will be
-- published (topic, key, value, headers), so publishing it again after a relay crash repeats the same task,
-- which its idempotency key makes harmless.
CREATE TABLE IF NOT EXISTS taskq_outbox (
    id          bigserial PRIMARY KEY,
    namespace   text NOT NULL,
    topic       text NOT NULL,
    key         bytea,
    value       bytea NOT NULL,
    headers     jsonb NOT NULL,  -- [[name, hex of the value], ...], in order
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS taskq_outbox_namespace_id ON taskq_outbox (namespace, id);
