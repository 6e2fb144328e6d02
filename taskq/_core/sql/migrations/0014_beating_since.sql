-- When each worker's first beat after a gap longer than stale_after came: empty until a gap (a worker that
-- starts judges by the heartbeats, as before). Postgres unreachable for longer than stale_after without
-- restarting (a network partition, a proxy restarted, a failover to a standby started long ago) leaves every
-- worker's heartbeat stale when it ends; judged by the heartbeats alone, the first claim after it took over
-- the keys of workers that were alive all along (their outcomes refused, their runs redone, interruptions
-- charged to keys they ran as suspects). A claimer now judges nobody while its own record is stale, and
-- after its first beat following a gap it counts staleness from that beat: the live workers cut off with it
-- beat again within stale_after.
ALTER TABLE taskq_workers ADD COLUMN beating_since timestamptz;
