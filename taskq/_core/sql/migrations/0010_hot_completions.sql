-- Claims and completions at about an upsert's cost (issue 21).
-- The primary key leads with the idempotency key: a batch's keys (`idempotency_key = ANY(keys)`) are its way
-- in, one probe each, however many keys the namespace holds. Led by the namespace, a new, unanalyzed table
-- was planned as a scan of the namespace's whole range per completion batch.
ALTER TABLE taskq_tasks DROP CONSTRAINT taskq_tasks_pkey;
ALTER TABLE taskq_tasks ADD CONSTRAINT taskq_tasks_pkey PRIMARY KEY (idempotency_key, namespace);
-- Completions are HOT updates: no index on a column they change (updated_at was one), and room on every page
-- for the new versions of the rows claimed into it (a batch's rows are completed together, before their old
-- versions can be pruned). Purge and the console's completion rate go in by created_at, which only the
-- first claim writes. Pages written before this keep their rows packed: those are mostly finished already.
DROP INDEX IF EXISTS taskq_tasks_updated_at;
CREATE INDEX IF NOT EXISTS taskq_tasks_created_at ON taskq_tasks (created_at);
ALTER TABLE taskq_tasks SET (fillfactor = 50);
