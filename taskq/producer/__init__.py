"""The producer library: enqueue typed, schema-validated tasks onto priority topics.

Its public names (`TaskProducer`, `TaskSpec`, `RateLimit`, the errors) are re-exported by `taskq`.
"""
