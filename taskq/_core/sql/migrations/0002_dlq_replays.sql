-- DLQ replays: one row per replayed DLQ record, so a second replay is refused unless forced.
-- Keyed by topic and offset: namespaces may share one database schema, and each has its own DLQ topic.
CREATE TABLE IF NOT EXISTS taskq_dlq_replays (
    dlq_topic       text NOT NULL,
    dlq_offset      bigint NOT NULL,
    task_id         text,
    idempotency_key text,
    replayed_at     timestamptz NOT NULL DEFAULT now(),
    replays         integer NOT NULL DEFAULT 1,
    PRIMARY KEY (dlq_topic, dlq_offset)
);
