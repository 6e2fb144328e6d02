-- Every SQL statement of taskq, by name; taskq._core.store.Store runs them, one method each.
-- Parameters are psycopg named placeholders.

-- name: take_tokens
-- Refill a shared bucket for the time elapsed since its last use and take up to `want` whole tokens, in one
-- atomic statement. Every SET expression reads the old row, so refill and take are consistent under concurrency.
-- A paused bucket (pause_tokens) has its updated_at in the future: it refills nothing and grants nothing until
-- then, and `paused` says for how long still.
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
    updated_at = GREATEST(b.updated_at, clock_timestamp())
RETURNING last_granted AS granted, tokens, rate,
    GREATEST(0, EXTRACT(EPOCH FROM updated_at - clock_timestamp())) AS paused;

-- name: pause_tokens
-- Pause a shared bucket for every process drawing from it (a handler was told to back off, e.g. an HTTP 429
-- with Retry-After): it is emptied and refills from the end of the pause. A longer pause already set stays.
INSERT INTO taskq_rate_buckets AS b (name, rate, capacity, tokens, last_granted, updated_at)
VALUES (%(name)s, %(rate)s, %(capacity)s, 0, 0, clock_timestamp() + %(seconds)s * interval '1 second')
ON CONFLICT (name) DO UPDATE SET
    tokens = 0,
    updated_at = GREATEST(b.updated_at, clock_timestamp() + %(seconds)s * interval '1 second');

-- name: claim
-- Claim idempotency keys of one namespace for one attempt each, in one round trip. A key is claimed when it
-- is new, failed (or replayed), dead for a task other than the one dead-lettered (a new enqueue of the key),
-- running under an expired lease, or running under the lease of a worker presumed dead: its liveness record
-- is stale or marked dead (invariant 9). Claiming counts the attempt before the task runs, so a task that
-- kills its worker still uses up its attempts; but a key taken over from a dead worker keeps its attempt
-- number (a worker holds the keys it claimed ahead too, and those never ran). Such a claim counts a
-- takeover, and an interruption only if the dead worker had marked the run started (mark_started); `started`
-- is reset by every claim. Taking over stays safe if the owner was in fact alive, since only the lease
-- holder's current attempt may complete. Rows of completed keys and of keys leased by a live worker come
-- back with their state so the worker can skip or hold them; so do dead keys asked for by the task that was
-- dead-lettered: a redelivery of it (its offset was not committed before its worker died) is skipped, not
-- dead-lettered a second time.
-- Most keys are new: `fresh` inserts them, one probe of the primary key each, and nothing else touches them.
-- Only the keys that have a record already (`known`) are looked up again, taken over or retried in `taken`
-- (the row lock it takes re-checks the conditions on the row's latest version), and reported as they are.
-- A key inserted by a concurrent claim after this statement's snapshot is neither inserted (the insert waits
-- for that claim and finds the key) nor seen by `taken` and the lookup: it comes back without a state,
-- which the worker holds and claims again shortly. One timestamp for the whole statement.
-- Only the known keys come back: a key without a row in the answer was new, and is claimed as its first
-- attempt. Arrays are sent in binary (%(name)b): parsing their text form cost more than the rest.
WITH input AS (
    SELECT * FROM unnest(%(keys)b::text[], %(task_ids)b::text[], %(task_types)b::text[], %(leases)b::float8[])
        AS i(idempotency_key, task_id, task_type, lease_seconds)
), fresh AS (
    INSERT INTO taskq_tasks
        (namespace, idempotency_key, task_id, task_type, state, attempts, lease_owner, lease_expires_at,
         created_at, updated_at)
    SELECT %(namespace)s, idempotency_key, task_id, task_type, 'running', 1, %(owner)s,
           statement_timestamp() + lease_seconds * interval '1 second', statement_timestamp(),
           statement_timestamp()
    FROM input
    ON CONFLICT (namespace, idempotency_key) DO NOTHING
    RETURNING idempotency_key
), known AS MATERIALIZED (
    SELECT * FROM input WHERE idempotency_key NOT IN (SELECT idempotency_key FROM fresh)
), me AS MATERIALIZED (
    SELECT heartbeat_at, beating_since FROM taskq_workers WHERE worker_id = %(owner)s
), dead_workers AS MATERIALIZED (
    -- A few rows, one per worker: read once per statement, never per key, and only if a key is known.
    -- No worker can beat while Postgres is down or out of reach, and when that ends every record is stale:
    -- judged by the heartbeats alone, the first claim took live workers' keys over (their outcomes refused,
    -- their runs redone, interruptions charged). So staleness counts from the server's start at the
    -- earliest, and from the claimer's own first beat after a gap longer than stale_after (`beating_since`:
    -- others that were cut off with it beat again within that time); and a claimer whose own record is
    -- stale (it was cut off too and has not beaten since) judges nobody by heartbeats. A claimer without a
    -- record (tools) judges by the heartbeats and the restart alone.
    SELECT worker_id FROM taskq_workers
    WHERE dead_at IS NOT NULL
       OR (GREATEST(heartbeat_at, pg_postmaster_start_time(), (SELECT beating_since FROM me))
             < statement_timestamp() - %(stale_after)s * interval '1 second'
           AND NOT EXISTS (SELECT FROM me
                           WHERE me.heartbeat_at < statement_timestamp() - %(stale_after)s * interval '1 second'))
), taken AS (
    UPDATE taskq_tasks t SET
        state = 'running',
        attempts = CASE WHEN t.state = 'running' AND t.lease_owner <> %(owner)s
                             AND t.lease_owner IN (SELECT worker_id FROM dead_workers)
                        THEN t.attempts ELSE t.attempts + 1 END,
        takeovers = CASE WHEN t.state = 'running' AND t.lease_owner <> %(owner)s
                              AND t.lease_owner IN (SELECT worker_id FROM dead_workers)
                         THEN t.takeovers + 1 ELSE t.takeovers END,
        interruptions = CASE WHEN t.state = 'running' AND t.lease_owner <> %(owner)s
                                  AND t.lease_owner IN (SELECT worker_id FROM dead_workers) AND t.started
                             THEN t.interruptions + 1 ELSE t.interruptions END,
        started = false,
        task_id = k.task_id,
        lease_owner = %(owner)s,
        lease_expires_at = statement_timestamp() + k.lease_seconds * interval '1 second',
        updated_at = statement_timestamp()
    FROM known k
    -- Plan stability: `= ANY(...)` on the primary key's first column is the way in, whatever the statistics.
    WHERE t.idempotency_key = ANY(ARRAY(SELECT idempotency_key FROM known)) AND t.namespace = %(namespace)s
      AND t.idempotency_key = k.idempotency_key
      -- Conditions on the row alone (a dead key's task compared by a hashed lookup, not against the joined
      -- request): they filter the rows found by key, and the join stays a plain one on the key.
      AND (t.state = 'failed'
        OR (t.state = 'dead' AND (t.idempotency_key, t.task_id) NOT IN (SELECT idempotency_key, task_id FROM known))
        OR (t.state = 'running' AND t.lease_expires_at < statement_timestamp())
        OR (t.state = 'running' AND t.lease_owner <> %(owner)s
            AND t.lease_owner IN (SELECT worker_id FROM dead_workers)))
    RETURNING t.idempotency_key, t.attempts, t.takeovers, t.interruptions
)
SELECT idempotency_key, 'claimed' AS outcome, attempts, takeovers, interruptions, 0.0::float8 AS lease_left
FROM taken
UNION ALL
SELECT k.idempotency_key, t.state, t.attempts, t.takeovers, t.interruptions,
       EXTRACT(EPOCH FROM t.lease_expires_at - statement_timestamp())::float8
FROM known k
-- Plan stability: one primary-key lookup per known key, whatever the table's statistics say (OFFSET 0 keeps
-- the lookup a subquery of its own). A plain join is planned as a scan of the whole table while the table
-- is new and unanalyzed, and such a plan is kept while the table grows.
LEFT JOIN LATERAL (
    SELECT state, attempts, takeovers, interruptions, lease_expires_at FROM taskq_tasks x
    WHERE x.namespace = %(namespace)s AND x.idempotency_key = k.idempotency_key OFFSET 0
) t ON true
WHERE k.idempotency_key NOT IN (SELECT idempotency_key FROM taken);

-- name: complete
-- Record completions. Only the lease holder's current attempt may complete a key: a late attempt whose
-- lease was taken over completes nothing (and, in a handler's transaction, rolls its effect back). No
-- column it writes is indexed and the table leaves room on each page, so a completion is a HOT update: the
-- new row version goes on the same page, and no index gets an entry. Answers the keys not recorded (their
-- leases were lost): none, nearly always.
WITH done AS (
UPDATE taskq_tasks t SET
    state = 'completed', result = c.result, completed_at = statement_timestamp(),
    updated_at = statement_timestamp(), lease_owner = NULL, lease_expires_at = NULL, last_error = NULL
FROM unnest(%(keys)b::text[], %(attempts)b::int[], %(results)b::jsonb[]) AS c(idempotency_key, attempts, result)
-- Plan stability: `= ANY(keys)` on the primary key's first column makes it the way in, whatever the
-- statistics say; on a new, unanalyzed table the join alone was planned as a scan of the whole table per key.
WHERE t.idempotency_key = ANY(%(keys)b::text[]) AND t.namespace = %(namespace)s
  AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key
)
SELECT key AS idempotency_key FROM unnest(%(keys)b::text[]) AS key
WHERE key NOT IN (SELECT idempotency_key FROM done);

-- name: fail
-- Record failed attempts: 'failed' stays retryable, 'dead' was dead-lettered (with where its DLQ record is).
-- A failed attempt of a task asked to stop (cancel) is not retried: it ends 'cancelled'. Same lease guard as
-- complete.
UPDATE taskq_tasks t SET
    state = CASE WHEN c.state = 'failed' AND t.cancel_requested THEN 'cancelled' ELSE c.state END,
    last_error = c.error, updated_at = statement_timestamp(), lease_owner = NULL,
    lease_expires_at = NULL, dlq_partition = c.dlq_partition, dlq_offset = c.dlq_offset
FROM unnest(%(keys)b::text[], %(attempts)b::int[], %(states)b::text[], %(errors)b::text[],
            %(dlq_partitions)s::int[], %(dlq_offsets)s::bigint[])
    AS c(idempotency_key, attempts, state, error, dlq_partition, dlq_offset)
WHERE t.idempotency_key = ANY(%(keys)b::text[]) AND t.namespace = %(namespace)s
  AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key, t.state;

-- name: release
-- Give back keys claimed ahead whose attempts never started (their partition was revoked, or the worker is
-- stopping): the attempt is uncounted and the lease ends now, so the partition's new owner claims the key at
-- once with the same attempt number. Only the lease holder's current attempt is released.
UPDATE taskq_tasks t SET
    attempts = t.attempts - 1, lease_owner = NULL,
    lease_expires_at = statement_timestamp() - interval '1 microsecond', updated_at = statement_timestamp()
FROM unnest(%(keys)b::text[], %(attempts)b::int[]) AS c(idempotency_key, attempts)
WHERE t.idempotency_key = ANY(%(keys)b::text[]) AND t.namespace = %(namespace)s
  AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: renew
-- Extend the leases of claimed keys about to start after a long wait in the buffer: the lease then covers
-- the run. A key whose lease was taken over meanwhile is not renewed (and must not run here).
UPDATE taskq_tasks t SET
    lease_expires_at = statement_timestamp() + c.lease_seconds * interval '1 second',
    updated_at = statement_timestamp()
FROM unnest(%(keys)b::text[], %(attempts)b::int[], %(leases)b::float8[]) AS c(idempotency_key, attempts, lease_seconds)
WHERE t.idempotency_key = ANY(%(keys)b::text[]) AND t.namespace = %(namespace)s
  AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: mark_started
-- Mark the runs about to start of keys taken over before (a plain key's run writes nothing): should their
-- worker die now, the takeover counts an interruption, and a poison pill reaches the DLQ. Only the lease
-- holder's current attempt is marked; a key whose lease was taken over meanwhile is not (and must not run).
UPDATE taskq_tasks t SET started = true
FROM unnest(%(keys)b::text[], %(attempts)b::int[]) AS c(idempotency_key, attempts)
WHERE t.idempotency_key = ANY(%(keys)b::text[]) AND t.namespace = %(namespace)s
  AND t.idempotency_key = c.idempotency_key
  AND t.state = 'running' AND t.lease_owner = %(owner)s AND t.attempts = c.attempts
RETURNING t.idempotency_key;

-- name: reset_for_replay
-- A DLQ replay starts the key's attempts over; a completed key stays completed (no second effect).
UPDATE taskq_tasks SET attempts = 0, takeovers = 0, interruptions = 0, state = 'failed', updated_at = clock_timestamp()
WHERE namespace = %(namespace)s AND idempotency_key = %(key)s AND state = 'dead'
RETURNING idempotency_key;

-- name: cancel
-- Cancel a key: one that has no record yet (not claimed: waiting in a tier, a delay tier or a worker's buffer)
-- or is waiting for its next attempt or for a new owner gets the record 'cancelled', and the claim of its
-- task then answers it like a completed key: it never starts. A running key is asked to stop
-- (cancel_requested): its handler sees ctx.cancelled and its outcome is recorded as usual. A finished key
-- is left as it is. The key's row is locked first (a claim of it waits, or is waited for), so the answer,
-- the state before, is the state the cancel acted on. Nothing comes back when a claim inserted the key
-- after this statement's snapshot: the caller runs it again.
WITH before AS (
    SELECT state, lease_owner, attempts FROM taskq_tasks
    WHERE idempotency_key = %(key)s AND namespace = %(namespace)s
    FOR UPDATE
), fresh AS (
    INSERT INTO taskq_tasks
        (namespace, idempotency_key, task_id, task_type, state, attempts, cancel_requested, created_at,
         updated_at, completed_at)
    SELECT %(namespace)s, %(key)s, %(task_id)s, '', 'cancelled', 0, true, statement_timestamp(),
           statement_timestamp(), statement_timestamp()
    WHERE NOT EXISTS (SELECT FROM before)
    ON CONFLICT (idempotency_key, namespace) DO NOTHING
    RETURNING 'unknown'::text AS state
), changed AS (
    UPDATE taskq_tasks t SET
        state = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL THEN t.state ELSE 'cancelled' END,
        cancel_requested = true,
        lease_owner = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL THEN t.lease_owner END,
        lease_expires_at = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL THEN t.lease_expires_at END,
        completed_at = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL THEN NULL
                            ELSE statement_timestamp() END,
        updated_at = statement_timestamp()
    FROM before b
    WHERE t.idempotency_key = %(key)s AND t.namespace = %(namespace)s AND b.state IN ('running', 'failed')
    RETURNING b.state
)
SELECT state, attempts, lease_owner FROM before
UNION ALL SELECT state, 0, NULL FROM fresh;

-- name: cancel_requested
-- Which of these running keys were asked to stop (cancel): read every few seconds for the tasks a worker
-- runs, one primary-key probe each.
SELECT idempotency_key FROM taskq_tasks
WHERE idempotency_key = ANY(%(keys)s::text[]) AND namespace = %(namespace)s AND cancel_requested;

-- name: get
-- One key's record; a plain read that takes no row locks and sees committed changes only.
SELECT idempotency_key, task_id, task_type, state, attempts, takeovers, interruptions, started, lease_owner,
       lease_expires_at, last_error, result, created_at, updated_at, completed_at, cancel_requested,
       dlq_partition, dlq_offset
FROM taskq_tasks WHERE namespace = %(namespace)s AND idempotency_key = %(key)s;

-- name: purge
-- Forget finished keys of one namespace older than the TTL, a bounded batch at a time so the table is never locked for long.
-- Keys in `keep` (those of tasks still in the DLQ) are never forgotten: a replay must still find them.
-- The way in is the index on created_at (a key finishes after it is first claimed, so every key finished
-- before the cutoff was created before it); updated_at, when the key finished, decides. updated_at has no
-- index of its own: a completion changes it, and must change no indexed column to be a HOT update.
DELETE FROM taskq_tasks WHERE ctid IN (
    SELECT ctid FROM taskq_tasks
    WHERE created_at < statement_timestamp() - %(ttl_seconds)s * interval '1 second'
      AND namespace = %(namespace)s AND state IN ('completed', 'dead', 'cancelled')
      AND updated_at < statement_timestamp() - %(ttl_seconds)s * interval '1 second'
      AND NOT (idempotency_key = ANY(%(keep)s::text[]))
    LIMIT %(batch)s
);

-- name: purge_idle
-- Forget rows that no longer say anything, so the tables stay small: shared token buckets refilled to the
-- brim since their last use (a missing bucket starts full: the same bucket), and the namespace's concurrency
-- slots whose lease ended (never live again). A concurrent use of a bucket changes its row first, and the
-- delete then looks at the new row; both are written again on their next use.
WITH buckets AS (
    DELETE FROM taskq_rate_buckets
    WHERE updated_at <= clock_timestamp()
      AND tokens + EXTRACT(EPOCH FROM clock_timestamp() - updated_at) * rate >= capacity
    RETURNING 1
), slots AS (
    DELETE FROM taskq_slots WHERE namespace = %(namespace)s AND lease_expires_at < clock_timestamp()
    RETURNING 1
)
SELECT (SELECT count(*) FROM buckets) AS buckets, (SELECT count(*) FROM slots) AS slots;

-- name: counts
-- Records of one namespace per state, a snapshot: no locks, so it may trail concurrent claims.
SELECT state, count(*) AS n FROM taskq_tasks WHERE namespace = %(namespace)s GROUP BY state;

-- name: worker_beat
-- A worker's liveness record, written at its start and on every heartbeat: alive now, with this many tasks
-- in flight. A record marked dead by mistake comes back to life (its lost leases stay lost).
-- A beat that follows a gap longer than stale_after sets `beating_since` (migration 0014).
INSERT INTO taskq_workers AS w
    (worker_id, namespace, worker_group, host, pid, concurrency, in_flight, started_at, heartbeat_at)
VALUES (%(worker_id)s, %(namespace)s, %(group)s, %(host)s, %(pid)s, %(concurrency)s, %(in_flight)s,
        %(started_at)s, clock_timestamp())
ON CONFLICT (worker_id) DO UPDATE SET
    heartbeat_at = clock_timestamp(), in_flight = EXCLUDED.in_flight, dead_at = NULL,
    beating_since = CASE WHEN w.heartbeat_at < clock_timestamp() - %(stale_after)s * interval '1 second'
                         THEN clock_timestamp() ELSE w.beating_since END;

-- name: worker_leave
-- A clean stop: the worker's liveness record goes (its keys were completed, failed or released).
DELETE FROM taskq_workers WHERE worker_id = %(worker_id)s;

-- name: workers_on_host
-- The live-looking workers of a host started before a starting worker, for it to check whose process is gone.
SELECT worker_id, pid FROM taskq_workers
WHERE host = %(host)s AND worker_id <> %(worker_id)s AND started_at <= %(started_at)s AND dead_at IS NULL;

-- name: workers_mark_dead
-- Mark workers dead (their process is gone): the next claim of a key they leased takes it over.
UPDATE taskq_workers SET dead_at = clock_timestamp() WHERE worker_id = ANY(%(worker_ids)s::text[]) AND dead_at IS NULL
RETURNING worker_id;

-- name: workers_prune
-- Forget the liveness records of workers silent for longer than any lease lasts (killed, never removed).
DELETE FROM taskq_workers WHERE heartbeat_at < clock_timestamp() - %(older_than)s * interval '1 second';

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
-- Attempts beyond the first in one namespace, over every worker: the retry count `taskq stats` shows.
SELECT count(*) FILTER (WHERE attempts > 1) AS tasks, COALESCE(sum(GREATEST(attempts - 1, 0)), 0) AS retries
FROM taskq_tasks WHERE namespace = %(namespace)s;

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

-- name: slots_lock
-- Serialize the acquirers of the same concurrency keys until the transaction ends: an advisory lock per
-- (namespace, task type, key), taken in hash order so two batches locking overlapping keys never deadlock.
SELECT h, pg_advisory_xact_lock(h)::text AS locked FROM (
    SELECT DISTINCT hashtextextended(%(namespace)s || chr(31) || t || chr(31) || k, 7) AS h
    FROM unnest(%(task_types)s::text[], %(slot_keys)s::text[]) AS i(t, k)
    ORDER BY h OFFSET 0
) s;

-- name: slots_acquire
-- Take a slot for each requested task whose key holds fewer than its limit of live slots, earlier requests of
-- a key first; run after slots_lock in the same transaction, so its snapshot sees every slot committed by the
-- key's earlier acquirers and no later one can commit meanwhile. A slot is live while its lease lasts and its
-- owner's heartbeat is fresh; dead ones of the requested keys are deleted here. A task's own earlier slot (a
-- redelivery) is replaced, not counted.
WITH input AS (
    SELECT * FROM unnest(%(keys)s::text[], %(task_types)s::text[], %(slot_keys)s::text[], %(limits)s::int[],
                         %(leases)s::float8[]) WITH ORDINALITY
        AS i(idempotency_key, task_type, slot_key, lim, lease_seconds, n)
), me AS MATERIALIZED (
    SELECT heartbeat_at, beating_since FROM taskq_workers WHERE worker_id = %(owner)s
), dead_workers AS MATERIALIZED (
    -- Staleness counts from the server's start and the acquirer's `beating_since` at the earliest, and an
    -- acquirer whose own record is stale judges nobody by heartbeats, as in `claim`.
    SELECT worker_id FROM taskq_workers
    WHERE dead_at IS NOT NULL
       OR (GREATEST(heartbeat_at, pg_postmaster_start_time(), (SELECT beating_since FROM me))
             < clock_timestamp() - %(stale_after)s * interval '1 second'
           AND NOT EXISTS (SELECT FROM me
                           WHERE me.heartbeat_at < clock_timestamp() - %(stale_after)s * interval '1 second'))
), held AS MATERIALIZED (
    SELECT s.idempotency_key, s.task_type, s.slot_key,
           s.lease_expires_at > clock_timestamp() AND s.owner NOT IN (SELECT worker_id FROM dead_workers) AS live
    FROM taskq_slots s
    WHERE s.namespace = %(namespace)s AND (s.task_type, s.slot_key) IN (SELECT task_type, slot_key FROM input)
), pruned AS (
    DELETE FROM taskq_slots s USING held h
    WHERE s.namespace = %(namespace)s AND s.idempotency_key = h.idempotency_key AND NOT h.live
      AND h.idempotency_key <> ALL(%(keys)s::text[])
), live AS (
    SELECT task_type, slot_key, count(*) AS n FROM held
    WHERE live AND idempotency_key <> ALL(%(keys)s::text[])
    GROUP BY task_type, slot_key
), ranked AS (
    SELECT i.*, row_number() OVER (PARTITION BY i.task_type, i.slot_key ORDER BY i.n) AS rank,
           COALESCE(l.n, 0) AS live
    FROM input i LEFT JOIN live l ON l.task_type = i.task_type AND l.slot_key = i.slot_key
)
INSERT INTO taskq_slots AS s (namespace, idempotency_key, task_type, slot_key, owner, lease_expires_at)
SELECT %(namespace)s, idempotency_key, task_type, slot_key, %(owner)s,
       clock_timestamp() + lease_seconds * interval '1 second'
FROM ranked WHERE live + rank <= lim
ON CONFLICT (namespace, idempotency_key) DO UPDATE SET
    task_type = EXCLUDED.task_type, slot_key = EXCLUDED.slot_key, owner = EXCLUDED.owner,
    lease_expires_at = EXCLUDED.lease_expires_at, acquired_at = clock_timestamp()
RETURNING s.idempotency_key;

-- name: slots_release
-- Give back the slots of tasks whose attempts ended (or never started); only the owner's own slots.
DELETE FROM taskq_slots WHERE namespace = %(namespace)s AND idempotency_key = ANY(%(keys)s::text[])
  AND owner = %(owner)s;

-- name: pause
-- Pause a tier or a task type; pausing what is paused already keeps its first time (no row returned).
INSERT INTO taskq_pauses (namespace, kind, name) VALUES (%(namespace)s, %(kind)s, %(name)s)
ON CONFLICT (namespace, kind, name) DO NOTHING
RETURNING paused_at;

-- name: resume
-- Resume a tier or a task type; no row returned if it was not paused.
DELETE FROM taskq_pauses WHERE namespace = %(namespace)s AND kind = %(kind)s AND name = %(name)s
RETURNING paused_at;

-- name: pauses
-- What is paused in a namespace: a few rows, read by every worker every couple of seconds, never per task.
SELECT kind, name, paused_at FROM taskq_pauses WHERE namespace = %(namespace)s ORDER BY kind, name;

-- name: workers_alive
-- The liveness records of a namespace whose heartbeat is recent and that nobody marked dead, for the console.
SELECT worker_id, worker_group, host, pid, concurrency, in_flight, started_at, heartbeat_at
FROM taskq_workers
WHERE namespace = %(namespace)s AND dead_at IS NULL
  AND heartbeat_at >= clock_timestamp() - %(stale_after)s * interval '1 second'
ORDER BY started_at;

-- name: task_by_id
-- The record of the task with this id (the console's lookup). A scan of the namespace's records: task ids
-- carry no index, kept off the claim's hot path; an operator's lookup can afford it.
SELECT idempotency_key, task_id, task_type, state, attempts, takeovers, interruptions, started, lease_owner,
       lease_expires_at, last_error, result, created_at, updated_at, completed_at, cancel_requested,
       dlq_partition, dlq_offset
FROM taskq_tasks WHERE namespace = %(namespace)s AND task_id = %(task_id)s
ORDER BY updated_at DESC LIMIT 1;

-- name: completed_since
-- Tasks of a namespace completed in the last `seconds` seconds, among those first claimed in that time: the
-- console's completion rate. The way in is the index on created_at; the time of a completion has no index,
-- so that completions stay HOT updates (see complete). A task first claimed earlier (a retry, or a run
-- longer than the window) is not counted.
SELECT count(*) AS n FROM taskq_tasks
WHERE created_at >= statement_timestamp() - %(seconds)s * interval '1 second'
  AND namespace = %(namespace)s AND state = 'completed'
  AND completed_at >= statement_timestamp() - %(seconds)s * interval '1 second';

-- name: wf_create
-- A new workflow's row, in the transaction that writes its nodes and stages its first tasks.
INSERT INTO taskq_workflows (namespace, workflow_id) VALUES (%(namespace)s, %(workflow_id)s);

-- name: wf_insert_nodes
-- A new workflow's nodes: its tree in preorder, each task with its record encoded and validated already.
INSERT INTO taskq_workflow_nodes
    (namespace, workflow_id, node, step, last, parent, position, kind, on_failure, task_id, idempotency_key,
     task_type, topic, key, value, headers)
SELECT %(namespace)s, %(workflow_id)s, node, %(workflow_id)s || ':' || node, last, parent, position, kind,
       on_failure, task_id, idempotency_key, task_type, topic, key, value, headers
FROM unnest(%(nodes)s::int[], %(lasts)s::int[], %(parents)s::int[], %(positions)s::int[], %(kinds)s::text[],
            %(on_failures)s::text[], %(task_ids)s::text[], %(keys)s::text[], %(task_types)s::text[],
            %(topics)s::text[], %(record_keys)s::bytea[], %(values)s::bytea[], %(headers)s::jsonb[])
    AS n(node, last, parent, position, kind, on_failure, task_id, idempotency_key, task_type, topic, key, value,
         headers);

-- name: wf_end
-- End nodes: a task that completed, died or was cancelled, or a chain or group whose turn is over. Only an
-- open node ends, once: a redelivered task whose node ended already changes nothing. The row lock each
-- update takes is what a group's last member is told apart by (wf_group_unlocked).
UPDATE taskq_workflow_nodes n SET state = e.state, result_key = e.result_key, ended_at = clock_timestamp()
FROM unnest(%(steps)s::text[], %(states)s::text[], %(result_keys)s::text[]) AS e(step, state, result_key)
-- Plan stability: `= ANY(steps)` on the unique index's first column is the way in, whatever the statistics.
WHERE n.step = ANY(%(steps)s::text[]) AND n.namespace = %(namespace)s AND n.step = e.step
  AND n.state IN ('waiting', 'running')
RETURNING n.workflow_id, n.node, n.last, n.parent, n.position, n.kind, n.on_failure, n.state, n.result_key,
    -- Its parent's place in the tree (never changes), so moving on needs no statement more to find it.
    (SELECT json_build_array(p.node, p.last, p.parent, p.position, p.kind, p.on_failure)
     FROM taskq_workflow_nodes p
     WHERE p.step = n.workflow_id || ':' || n.parent AND p.namespace = n.namespace) AS parent_place;

-- name: wf_nodes
-- Nodes by step: their place in the tree and their state.
SELECT workflow_id, node, last, parent, position, kind, on_failure, state, result_key
FROM taskq_workflow_nodes
WHERE step = ANY(%(steps)s::text[]) AND namespace = %(namespace)s;

-- name: wf_child
-- The child of a node at a position (a chain's next step, a group's callback at -1), found in the node's
-- subtree by primary key.
SELECT workflow_id, node, last, parent, position, kind, on_failure, state, result_key
FROM taskq_workflow_nodes
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND node BETWEEN %(parent)s + 1 AND %(last)s
  AND parent = %(parent)s AND position = %(position)s;

-- name: wf_group_unlocked
-- One open member of a group, among the nodes from..to of its subtree, that no transaction is ending now,
-- share-locked: its ender's update waits for this transaction, so it will see this transaction's ends and
-- decide the group itself. None: every open member there is being ended by a transaction in flight (or none
-- is open). Asked first after the members this transaction ended (members end about in order, so an open one
-- is a few rows on), then before them. A row share-locked by another checker is not skipped (shares do not
-- conflict).
SELECT node FROM taskq_workflow_nodes
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND node BETWEEN %(from)s AND %(to)s
  AND parent = %(group)s AND position >= 0 AND state IN ('waiting', 'running')
ORDER BY node LIMIT 1 FOR SHARE SKIP LOCKED;

-- name: wf_group_lock
-- Lock a group's row: its deciders take turns, each seeing the members ended by those before it.
SELECT fired FROM taskq_workflow_nodes
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND node = %(group)s
FOR UPDATE;

-- name: wf_group_open
-- How many members of a group are still open, as committed now (read after wf_group_lock, a statement of
-- its own: under READ COMMITTED it sees every end committed before the lock was granted).
SELECT count(*) AS n FROM taskq_workflow_nodes g
JOIN taskq_workflow_nodes m ON m.workflow_id = g.workflow_id AND m.namespace = g.namespace
    AND m.node BETWEEN g.node + 1 AND g.last AND m.parent = g.node AND m.position >= 0
    AND m.state IN ('waiting', 'running')
WHERE g.workflow_id = %(workflow_id)s AND g.namespace = %(namespace)s AND g.node = %(group)s;

-- name: wf_group_fire
-- A group whose members all ended: marked decided, and its members counted by state. Under the group's lock.
WITH fired AS (
    UPDATE taskq_workflow_nodes SET fired = true
    WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND node = %(group)s AND NOT fired
    RETURNING node, last
)
SELECT m.state, count(*) AS n FROM fired f
JOIN taskq_workflow_nodes m ON m.workflow_id = %(workflow_id)s AND m.namespace = %(namespace)s
    AND m.node BETWEEN f.node + 1 AND f.last AND m.parent = f.node AND m.position >= 0
GROUP BY m.state;

-- name: wf_start
-- Start waiting nodes: tasks are staged (wf_stage), chains and groups start their first step or members.
UPDATE taskq_workflow_nodes SET state = 'running'
WHERE step = ANY(%(steps)s::text[]) AND namespace = %(namespace)s AND state = 'waiting'
RETURNING workflow_id, node, last, parent, position, kind, on_failure, state, result_key;

-- name: wf_first_steps
-- What starting chains and groups start: a chain's first step, a group's members (not its callback).
-- One range of the primary key per started node (a LATERAL probe each).
SELECT n.workflow_id, n.node FROM unnest(%(workflow_ids)s::text[], %(nodes)s::int[], %(lasts)s::int[],
                                         %(groups)s::bool[]) AS k(workflow_id, node, last, is_group)
CROSS JOIN LATERAL (
    SELECT workflow_id, node FROM taskq_workflow_nodes n
    WHERE n.workflow_id = k.workflow_id AND n.namespace = %(namespace)s AND n.node BETWEEN k.node + 1 AND k.last
      AND n.parent = k.node AND (n.position = 0 OR (k.is_group AND n.position > 0))
    OFFSET 0
) n;

-- name: wf_stage
-- Stage started tasks in the outbox, in the transaction that started them, in the order given; relays are
-- woken when, and only if, it commits.
WITH staged AS (
    INSERT INTO taskq_outbox (namespace, topic, key, value, headers)
    SELECT n.namespace, n.topic, n.key, n.value, n.headers
    FROM unnest(%(steps)s::text[]) WITH ORDINALITY AS k(step, i)
    JOIN taskq_workflow_nodes n ON n.step = k.step
    WHERE n.step = ANY(%(steps)s::text[]) AND n.namespace = %(namespace)s
    ORDER BY k.i
    RETURNING id
)
SELECT pg_notify('taskq_outbox', %(namespace)s) FROM (SELECT count(*) FROM staged) AS s;

-- name: wf_close
-- Close the waiting nodes below a node (a chain's steps after one that failed, a callback not run): they
-- will never start.
UPDATE taskq_workflow_nodes SET state = %(state)s, ended_at = clock_timestamp()
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND node BETWEEN %(node)s + 1 AND %(last)s
  AND state = 'waiting';

-- name: wf_cancelled
-- Which of these workflows were cancelled: their waiting nodes never start.
SELECT workflow_id FROM taskq_workflows
WHERE workflow_id = ANY(%(workflow_ids)s::text[]) AND namespace = %(namespace)s AND cancelled;

-- name: wf_finish
-- A workflow's root ended: the workflow is done.
UPDATE taskq_workflows SET state = %(state)s, ended_at = clock_timestamp()
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND state = 'running';

-- name: wf_get
-- A workflow's row.
SELECT workflow_id, state, cancelled, created_at, ended_at FROM taskq_workflows
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s;

-- name: wf_counts
-- A workflow's tasks by state.
SELECT state, count(*) AS n FROM taskq_workflow_nodes
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND kind = 'task'
GROUP BY state;

-- name: wf_tree
-- A workflow's nodes in preorder, for the console (at most `limit`).
SELECT node, last, parent, position, kind, on_failure, state, task_id, idempotency_key, task_type
FROM taskq_workflow_nodes
WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s
ORDER BY node LIMIT %(limit)s;

-- name: wf_cancel
-- Mark a workflow cancelled (its waiting nodes will never start); returns its tasks staged and not ended,
-- whose keys are cancelled next.
WITH marked AS (
    UPDATE taskq_workflows SET cancelled = true
    WHERE workflow_id = %(workflow_id)s AND namespace = %(namespace)s AND state = 'running'
    RETURNING workflow_id
)
SELECT n.idempotency_key, n.task_id FROM marked m
JOIN taskq_workflow_nodes n ON n.workflow_id = m.workflow_id AND n.namespace = %(namespace)s
WHERE n.kind = 'task' AND n.state = 'running';

-- name: cancel_many
-- Cancel many keys at once (a workflow's staged tasks), by the rules of cancel: no record or waiting for an
-- attempt or a new owner: cancelled; running: asked to stop; finished: left as it is. A key a claim inserts
-- concurrently is left to run (it had started). Answers the keys that were not started.
WITH fresh AS (
    INSERT INTO taskq_tasks
        (namespace, idempotency_key, task_id, task_type, state, attempts, cancel_requested, created_at,
         updated_at, completed_at)
    SELECT %(namespace)s, k, t, '', 'cancelled', 0, true, statement_timestamp(), statement_timestamp(),
           statement_timestamp()
    FROM unnest(%(keys)s::text[], %(task_ids)s::text[]) AS i(k, t)
    ON CONFLICT (idempotency_key, namespace) DO NOTHING
    RETURNING idempotency_key
), before AS (
    SELECT idempotency_key, state, lease_owner FROM taskq_tasks
    WHERE idempotency_key = ANY(%(keys)s::text[]) AND namespace = %(namespace)s
      AND state IN ('running', 'failed')
    FOR UPDATE
), changed AS (
    UPDATE taskq_tasks t SET
        state = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL THEN t.state ELSE 'cancelled' END,
        cancel_requested = true,
        lease_owner = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL THEN t.lease_owner END,
        lease_expires_at = CASE WHEN b.state = 'running' AND b.lease_owner IS NOT NULL
                                THEN t.lease_expires_at END,
        updated_at = statement_timestamp()
    FROM before b
    WHERE t.idempotency_key = b.idempotency_key AND t.namespace = %(namespace)s
    RETURNING t.idempotency_key, b.state, b.lease_owner
)
SELECT idempotency_key FROM fresh
UNION ALL
SELECT idempotency_key FROM changed WHERE NOT (state = 'running' AND lease_owner IS NOT NULL);

-- name: wf_results
-- A group's members in order, each with its result's record (the task's, or a chain's last step's).
SELECT m.node, m.position, m.kind, m.state, t.task_id, t.result, t.last_error
FROM taskq_workflow_nodes g
JOIN taskq_workflow_nodes m ON m.workflow_id = g.workflow_id AND m.namespace = g.namespace
    AND m.node BETWEEN g.node + 1 AND g.last AND m.parent = g.node AND m.position >= 0
LEFT JOIN taskq_tasks t ON t.idempotency_key = m.result_key AND t.namespace = m.namespace
WHERE g.workflow_id = %(workflow_id)s AND g.namespace = %(namespace)s AND g.node = %(group)s
ORDER BY m.position;

-- name: wf_purge
-- Forget workflows of one namespace that ended more than the TTL ago, with their nodes, a bounded batch at a
-- time. A scan of the namespace's workflows: one row each, far fewer than tasks.
WITH gone AS (
    DELETE FROM taskq_workflows WHERE ctid IN (
        SELECT ctid FROM taskq_workflows
        WHERE namespace = %(namespace)s AND state <> 'running'
          AND ended_at < statement_timestamp() - %(ttl_seconds)s * interval '1 second'
        LIMIT %(batch)s
    )
    RETURNING workflow_id
), nodes AS (
    DELETE FROM taskq_workflow_nodes n USING gone g
    WHERE n.workflow_id = g.workflow_id AND n.namespace = %(namespace)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS workflows, (SELECT count(*) FROM nodes) AS nodes;
