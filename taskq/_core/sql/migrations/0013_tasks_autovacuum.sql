-- Autovacuum for the idempotency table by counts of rows, not by a fifth of it (issue 21).
-- Every task writes taskq_tasks twice: its claim inserts a row and its completion replaces it (a HOT update,
-- migration 0010: the old version is dead at once), and the daily purge deletes the day of keys that passed
-- the TTL. With the server's defaults a table is vacuumed once a fifth of it is dead and analyzed once a
-- tenth changed: on a table of 7 days of keys (5M), 1M dead versions. A day's purge (an eighth of the table,
-- 628k rows) does not reach that by itself, and the space it frees is reused only once something else
-- triggers a vacuum; meanwhile the claims extend the table. Measured with `taskq bench latency
-- --seed-history 5000000` (docs/explanation/benchmarks.md, "Sustained run"): in 10 minutes at 3,000 tasks/s
-- the table grew 462 MB with these settings (9 vacuums, at most 787k dead tuples), 573 MB with the server's
-- (one vacuum, 95 s after the purge, at 1.2M).
ALTER TABLE taskq_tasks SET (
    -- Vacuum once 10,000 + 1% of the rows are dead (60k on 5M). Under load that is once a minute, as often
    -- as autovacuum looks at a database; each run took under 10 s, and the claims fill the pages it freed.
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_scale_factor = 0.01,
    -- The same count of new rows triggers one too. Pruning removes about half the completions' old versions
    -- on its own (the dead count grew by half the completions), so the claims' inserts are the steadier
    -- measure of the work: its run marks the finished pages all-visible, and later runs skip them.
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    -- Analyze once 10,000 + 2% changed: the row count the thresholds above scale with, and the statistics
    -- of created_at that the purge's range reads, stay close to the table.
    autovacuum_analyze_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);
-- The cost budget stays the server's: the run after the purge (628k deleted rows, both indexes scanned)
-- took 30-40 s at it, inside the minute between autovacuum's looks, while the claims' p99 stayed under 0.2 s.
