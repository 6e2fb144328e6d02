-- Idempotency records are keyed by namespace and key: namespaces sharing a database no longer skip each
-- other's keys. Rows already there take the namespace of the process running this migration, which
-- Database.migrate passes in the session setting taskq.namespace (TASKQ_NAMESPACE, default 'taskq').
ALTER TABLE taskq_tasks ADD COLUMN namespace text;
UPDATE taskq_tasks SET namespace = COALESCE(NULLIF(current_setting('taskq.namespace', true), ''), 'taskq');
ALTER TABLE taskq_tasks ALTER COLUMN namespace SET NOT NULL;
ALTER TABLE taskq_tasks DROP CONSTRAINT taskq_tasks_pkey;
ALTER TABLE taskq_tasks ADD CONSTRAINT taskq_tasks_pkey PRIMARY KEY (namespace, idempotency_key);
