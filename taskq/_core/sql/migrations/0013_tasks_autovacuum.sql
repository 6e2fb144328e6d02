-- Autovacuum for the idempotency table by counts of rows, not by a fifth of it (issue 21).
-- Every task writes taskq_tasks twice: its claim inserts a row and its completion replaces it (a HOT update,
-- migration 0010: the old version is dead at once), and the daily purge deletes a day of keys. Left to the
-- server's defaults, a table holding 7 days of keys (5M at ~8 tasks/s) is vacuumed after 20% of it is dead
-- (1M dead versions) and analyzed after 10% changed: the purge's 625k deleted rows never trigger a vacuum
-- by themselves, and the space they leave is reused only once one does. The values below were measured with
-- `taskq bench latency --seed-history 5000000` (see docs/explanation/benchmarks.md, "Sustained run").
ALTER TABLE taskq_tasks SET (
    -- Vacuum after 10,000 + 1% of the rows are dead (60k on 5M): a run that finds the dead versions of a
    -- few minutes of tasks, and a purge's deletes are reclaimed within a minute of the purge.
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_scale_factor = 0.01,
    -- The same count of new rows triggers one too: a claimed row is completed within seconds, so the
    -- insert-triggered run prunes the completions' old versions and marks the pages all-visible, and the
    -- next runs skip those pages.
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    -- Fresh statistics for the purge's range on created_at (its batches' plans): analyze after 2% changed.
    autovacuum_analyze_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    -- A run on a table of millions of rows finishes in seconds rather than minutes: five times the default
    -- budget of page reads and writes between its 2 ms sleeps, so it ends before the next one is due.
    autovacuum_vacuum_cost_limit = 1000
);
