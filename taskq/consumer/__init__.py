"""The worker runtime: run handlers of typed tasks from Kafka, each effect once, with retries and a DLQ.

Its modules are imported on use (`taskq.consumer.worker`, `taskq.consumer.handlers`, ...): a handler module
that imports `taskq.consumer.handlers` in a process-isolated child loads no worker loop. The public names
are re-exported by `taskq`.
"""
