-- Periodic tasks: one row per periodic task of a namespace, holding the last slot staged. A worker's scheduler
-- locks the row (SKIP LOCKED), stages the due slots in the outbox and advances last_slot in one transaction.
CREATE TABLE IF NOT EXISTS taskq_periodic (
    namespace  text NOT NULL,
    name       text NOT NULL,
    schedule   text NOT NULL DEFAULT '',
    catch_up   text NOT NULL DEFAULT 'last',
    last_slot  timestamptz,
    staged_at  timestamptz,
    PRIMARY KEY (namespace, name)
);
