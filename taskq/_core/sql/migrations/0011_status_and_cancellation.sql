-- Results, status and cancellation (issue 23).
-- A task cancelled before it started ends 'cancelled': the claim answers it like a completed key, and it never
-- runs. NOT VALID: every existing row passed the narrower check; new and updated rows are checked.
ALTER TABLE taskq_tasks DROP CONSTRAINT IF EXISTS taskq_tasks_state_check;
ALTER TABLE taskq_tasks ADD CONSTRAINT taskq_tasks_state_check
    CHECK (state IN ('running', 'failed', 'completed', 'dead', 'cancelled')) NOT VALID;
-- A running task asked to stop: its handler sees ctx.cancelled, and a failed attempt of it is not retried.
-- Where a dead task's DLQ record is (the DLQ topic is the namespace's): what result() reports.
-- None of them is indexed, and complete writes none of them: completions stay HOT updates (migration 0010).
ALTER TABLE taskq_tasks ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false;
ALTER TABLE taskq_tasks ADD COLUMN dlq_partition integer;
ALTER TABLE taskq_tasks ADD COLUMN dlq_offset bigint;
