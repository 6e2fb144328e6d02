"""The shared core below producer, consumer and schemas: envelope and topic names, settings, errors, and the
only modules that talk to Kafka (`kafka`) and Postgres (`db`). Internal: import names from `taskq`."""
