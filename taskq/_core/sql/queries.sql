-- Every SQL statement of taskq, by name; taskq._core.store.Store runs them, one method each.
-- Parameters are psycopg named placeholders.

-- name: take_tokens
-- Refill a shared bucket for the time elapsed since its last use and take up to `want` whole tokens, in one
-- atomic statement. Every SET expression reads the old row, so refill and take are consistent under concurrency.
INSERT INTO taskq_rate_buckets AS b (name, rate, capacity, tokens, last_granted, updated_at)
VALUES (%(name)s, %(rate)s, %(capacity)s,
        %(capacity)s - LEAST(%(want)s, floor(%(capacity)s)), LEAST(%(want)s, floor(%(capacity)s)), clock_timestamp())
ON CONFLICT (name) DO UPDATE SET
    rate = EXCLUDED.rate,
    capacity = EXCLUDED.capacity,
    last_granted = LEAST(%(want)s, floor(LEAST(b.capacity,
        b.tokens + GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - b.updated_at)) * b.rate))),
    tokens = LEAST(b.capacity, b.tokens + GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - b.updated_at)) * b.rate)
        - LEAST(%(want)s, floor(LEAST(b.capacity,
            b.tokens + GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - b.updated_at)) * b.rate))),
    updated_at = clock_timestamp()
RETURNING last_granted AS granted, tokens, rate;

-- name: claim
-- Claim idempotency keys for one attempt each, in one round trip. A key is claimed when it is new, failed,
-- dead (replayed), or running under an expired lease; claiming counts the attempt before the task runs, so a
-- task that kills its worker still uses up its attempts. Rows of completed keys and of keys leased by a live
-- worker come back with their state so the worker can skip or hold them.
WITH input AS (
    SELECT * FROM unnest(%(keys)s::text[], %(task_ids)s::text[], %(task_types)s::text[], %(leases)s::float8[])
        AS i(idempotency_key, task_id, task_type, lease_seconds)
), claimed AS (
    INSERT INTO taskq_tasks AS t
        (idempotency_key, task_id, task_type, state, attempts, lease_owner, lease_expires_at, updated_at)
    SELECT idempotency_key, task_id, task_type, 'running', 1, %(owner)s,
           clock_timestamp() + lease_seconds * interval '1 second', clock_timestamp()
    FROM input
    ON CONFLICT (idempotency_key) DO UPDATE SET
        state = 'running',
        attempts = t.attempts + 1,
        task_id = EXCLUDED.task_id,
        lease_owner = EXCLUDED.lease_owner,
        lease_expires_at = EXCLUDED.lease_expires_at,
        updated_at = EXCLUDED.updated_at
    WHERE t.state IN ('failed', 'dead') OR (t.state = 'running' AND t.lease_expires_at < clock_timestamp())
    RETURNING t.idempotency_key, t.attempts
)
SELECT i.idempotency_key,
       CASE WHEN c.idempotency_key IS NOT NULL THEN 'claimed' ELSE t.state END AS outcome,
       COALESCE(c.attempts, t.attempts) AS attempts,
       t.lease_owner,
       EXTRACT(EPOCH FROM t.lease_expires_at - clock_timestamp()) AS lease_left
FROM input i
LEFT JOIN claimed c ON c.idempotency_key = i.idempotency_key
-- Plan stability: one primary-key lookup per input key, whatever the table's statistics say (OFFSET 0 keeps
-- the lookup a subquery of its own). A plain join is planned as a scan of the whole table while the table
-- is new and unanalyzed, and such a plan is kept while the table grows.
LEFT JOIN LATERAL (
    SELECT state, attempts, lease_owner, lease_expires_at FROM taskq_tasks k
    WHERE k.idempotency_key = i.idempotency_key OFFSET 0
) t ON true;

-- name: complete
-- Record completions. Only the lease holder's current attempt may complete a key: a late attempt whose
-- lease was taken over completes nothing (and, in a handler's transaction, rolls its effect back).
UPDATE taskq_tasks t SET
    state = 'completed', result = c.result, completed_at = clock_timestamp(), updated_at = clock_timestamp(),
    lease_owner = NULL, lease_expires_at = NULL, last_error = NULL
FROM unnest(%(keys)s::text[], %(attempts)s::int[], %(results)s::jsonb[]) AS c(idempotency_key, attempts, result)
-- Plan stability: `= ANY(keys)` makes the primary key the way in, whatever the statistics say; on a new,
-- unanalyzed table the join alone was planned as a scan of the whole table per key.
WHERE t.idempotency_key = ANY(%(keys)s::text[]) AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: fail
-- Record failed attempts: 'failed' stays retryable, 'dead' was dead-lettered. Same lease guard as complete.
UPDATE taskq_tasks t SET
    state = c.state, last_error = c.error, updated_at = clock_timestamp(), lease_owner = NULL, lease_expires_at = NULL
FROM unnest(%(keys)s::text[], %(attempts)s::int[], %(states)s::text[], %(errors)s::text[])
    AS c(idempotency_key, attempts, state, error)
-- Plan stability: `= ANY(keys)` makes the primary key the way in, whatever the statistics say; on a new,
-- unanalyzed table the join alone was planned as a scan of the whole table per key.
WHERE t.idempotency_key = ANY(%(keys)s::text[]) AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: release
-- Give back keys claimed ahead whose attempts never started (their partition was revoked, or the worker is
-- stopping): the attempt is uncounted and the lease ends now, so the partition's new owner claims the key at
-- once with the same attempt number. Only the lease holder's current attempt is released.
UPDATE taskq_tasks t SET
    attempts = t.attempts - 1, lease_owner = NULL, lease_expires_at = clock_timestamp() - interval '1 microsecond',
    updated_at = clock_timestamp()
FROM unnest(%(keys)s::text[], %(attempts)s::int[]) AS c(idempotency_key, attempts)
WHERE t.idempotency_key = ANY(%(keys)s::text[]) AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: renew
-- Extend the leases of claimed keys about to start after a long wait in the buffer: the lease then covers
-- the run. A key whose lease was taken over meanwhile is not renewed (and must not run here).
UPDATE taskq_tasks t SET
    lease_expires_at = clock_timestamp() + c.lease_seconds * interval '1 second', updated_at = clock_timestamp()
FROM unnest(%(keys)s::text[], %(attempts)s::int[], %(leases)s::float8[]) AS c(idempotency_key, attempts, lease_seconds)
WHERE t.idempotency_key = ANY(%(keys)s::text[]) AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: reset_for_replay
-- A DLQ replay starts the key's attempts over; a completed key stays completed (no second effect).
UPDATE taskq_tasks SET attempts = 0, state = 'failed', updated_at = clock_timestamp()
WHERE idempotency_key = %(key)s AND state = 'dead'
RETURNING idempotency_key;

-- name: get
-- One key's record; a plain read that takes no row locks and sees committed changes only.
SELECT idempotency_key, task_id, task_type, state, attempts, lease_owner, lease_expires_at, last_error, result,
       created_at, updated_at, completed_at
FROM taskq_tasks WHERE idempotency_key = %(key)s;

-- name: purge
-- Forget finished keys older than the TTL, a bounded batch at a time so the table is never locked for long.
-- Keys in `keep` (those of tasks still in the DLQ) are never forgotten: a replay must still find them.
DELETE FROM taskq_tasks WHERE ctid IN (
    SELECT ctid FROM taskq_tasks
    WHERE state IN ('completed', 'dead') AND updated_at < clock_timestamp() - %(ttl_seconds)s * interval '1 second'
      AND NOT (idempotency_key = ANY(%(keep)s::text[]))
    LIMIT %(batch)s
);

-- name: counts
-- Records per state, a snapshot: no locks, so it may trail concurrent claims.
SELECT state, count(*) AS n FROM taskq_tasks GROUP BY state;

-- name: dlq_replayed
-- The replayed records of one DLQ topic, so listings can hide them.
SELECT dlq_offset, replayed_at, replays FROM taskq_dlq_replays WHERE dlq_topic = %(topic)s;

-- name: dlq_replayed_between
-- How many records of a DLQ offset range were replayed (depth = records in the log minus these).
SELECT count(*) AS n FROM taskq_dlq_replays
WHERE dlq_topic = %(topic)s AND dlq_offset >= %(start)s AND dlq_offset < %(end)s;

-- name: dlq_record_replay
-- Mark a DLQ record replayed; an earlier replay blocks it (no row returned) unless forced. Run in the
-- transaction that spans the re-enqueue, so concurrent replays of one record wait here and then see it.
INSERT INTO taskq_dlq_replays AS r (dlq_topic, dlq_offset, task_id, idempotency_key, replayed_at, replays)
VALUES (%(topic)s, %(offset)s, %(task_id)s, %(key)s, clock_timestamp(), 1)
ON CONFLICT (dlq_topic, dlq_offset) DO UPDATE SET replayed_at = EXCLUDED.replayed_at, replays = r.replays + 1
WHERE %(force)s
RETURNING replayed_at, replays;

-- name: retries
-- Attempts beyond the first, over every worker: the retry count `taskq stats` shows across processes.
SELECT count(*) FILTER (WHERE attempts > 1) AS tasks, COALESCE(sum(GREATEST(attempts - 1, 0)), 0) AS retries
FROM taskq_tasks;

-- name: outbox_stage
-- Stage tasks in the outbox, on the application's connection and inside its transaction ({schema} is the
-- project's schema, filled in as an identifier: that connection's search_path is the application's). The
-- notification reaches listening relays when, and only if, the transaction commits.
WITH staged AS (
    INSERT INTO {schema}.taskq_outbox (namespace, topic, key, value, headers)
    SELECT %(namespace)s, topic, key, value, headers
    FROM unnest(%(topics)s::text[], %(keys)s::bytea[], %(values)s::bytea[], %(headers)s::jsonb[])
        AS r(topic, key, value, headers)
    RETURNING id
)
SELECT pg_notify('taskq_outbox', %(namespace)s) FROM (SELECT count(*) FROM staged) AS s;

-- name: outbox_claim
-- The oldest staged tasks of a namespace, locked for this relay's transaction; rows another relay holds are
-- skipped, so relays publish disjoint batches.
SELECT id, topic, key, value, headers, EXTRACT(EPOCH FROM clock_timestamp() - created_at) AS age
FROM taskq_outbox WHERE namespace = %(namespace)s
ORDER BY id LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: outbox_delete
-- Forget published rows, in the transaction that claimed them.
DELETE FROM taskq_outbox WHERE id = ANY(%(ids)s::bigint[]);

-- name: outbox_backlog
-- Rows waiting in a namespace's outbox and the age of the oldest: the relay's lag, for stats and metrics.
SELECT count(*) AS n, COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0) AS oldest
FROM taskq_outbox WHERE namespace = %(namespace)s;

-- name: outbox_listen
-- Wake a relay when a transaction that staged tasks commits (outbox_stage notifies).
LISTEN taskq_outbox

-- name: periodic_ensure
-- Make sure a periodic task has its row (a new one has no last slot yet).
INSERT INTO taskq_periodic (namespace, name) VALUES (%(namespace)s, %(name)s)
ON CONFLICT (namespace, name) DO NOTHING;

-- name: periodic_lock
-- Lock a periodic task's row for this scheduler's transaction; no row if another scheduler holds it.
SELECT last_slot FROM taskq_periodic WHERE namespace = %(namespace)s AND name = %(name)s
FOR UPDATE SKIP LOCKED;

-- name: periodic_advance
-- Record the last slot staged, in the transaction that staged it.
UPDATE taskq_periodic SET last_slot = %(slot)s, schedule = %(schedule)s, catch_up = %(catch_up)s,
    staged_at = clock_timestamp()
WHERE namespace = %(namespace)s AND name = %(name)s;

-- name: periodic_list
-- Every periodic task of a namespace that a scheduler has seen, with its last slot.
SELECT name, schedule, catch_up, last_slot, staged_at FROM taskq_periodic
WHERE namespace = %(namespace)s ORDER BY name;
