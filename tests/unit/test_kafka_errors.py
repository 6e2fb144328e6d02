"""The client's errors become the project's, however the client raises them."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from taskq._core.errors import KafkaUnavailableError
from taskq._core.kafka_clients import client_errors


def test_a_client_error_raised_through_a_callback_is_the_projects_error_naming_it() -> None:
    fenced = KafkaException(KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True))
    with pytest.raises(KafkaUnavailableError, match=r"^flushing: fenced by a newer instance \(_FENCED\)$"):
        with client_errors("flushing"):
            # What a fenced producer's flush raised when a log line was served in the same call.
            raise SystemError("<class 'logging.LogRecord'> returned a result with an exception set") from (
                fenced
            )


def test_a_system_error_of_another_cause_is_not_taken_for_a_client_error() -> None:
    with pytest.raises(SystemError), client_errors("flushing"):
        raise SystemError("something else")
