-- Every SQL statement of taskq, by name. Loaded by producer.db; parameters are psycopg named placeholders.

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
