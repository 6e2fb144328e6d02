-- Pauses: a tier or a task type an operator paused (`taskq pause`, the console). Every worker of the
-- namespace reads the whole table every couple of seconds (a few rows) and stops starting the matching
-- tasks: a paused tier's partitions are paused, a paused type's tasks are held in the buffer.
CREATE TABLE IF NOT EXISTS taskq_pauses (
    namespace  text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('tier', 'task_type')),
    name       text NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (namespace, kind, name)
);
