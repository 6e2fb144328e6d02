-- Takeovers apart from interruptions. A takeover is any claim of a key leased by a dead worker, whether its
-- run had started or was merely claimed ahead in the worker's buffer; an interruption is a takeover of a run
-- known to have started: its worker marked it started before running it (`started`, reset by every claim).
-- A worker marks only the runs of keys taken over before, so a key's first run writes nothing and the first
-- takeover cannot tell a run from a claim ahead: the poison-pill rule presumes that one was a run.
ALTER TABLE taskq_tasks ADD COLUMN takeovers integer NOT NULL DEFAULT 0;
ALTER TABLE taskq_tasks ADD COLUMN started boolean NOT NULL DEFAULT false;
-- Until now every takeover counted as an interruption, the first one included: the same keys stay as close
-- to the poison-pill rule as they were.
UPDATE taskq_tasks SET takeovers = interruptions, interruptions = interruptions - 1 WHERE interruptions > 0;
