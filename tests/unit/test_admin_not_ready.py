"""Admin requests wait out a broker that is not ready yet, and report anything else at once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from taskq._core.errors import KafkaUnavailableError
from taskq._core.kafka import Admin
from taskq._core.settings import Settings


def _admin() -> Admin:
    # No request reaches a broker here: `_answered` is given the call to make.
    return Admin(Settings(bootstrap_servers="127.0.0.1:1", kafka_timeout=5.0))


@pytest.mark.parametrize(
    "code",
    # The first topics of a freshly started broker answered "Leader epoch is newer than broker epoch" in CI.
    [KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.FENCED_LEADER_EPOCH, KafkaError.NOT_LEADER_FOR_PARTITION],
)
def test_a_leader_not_settled_yet_is_waited_out(code: int) -> None:
    answers = iter([KafkaException(KafkaError(code)), KafkaException(KafkaError(code)), "ready"])

    def call(left: float) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert _admin()._answered("waiting for the partitions of new topics", call) == "ready"


def test_a_refusal_is_reported_at_once() -> None:
    calls: list[float] = []

    def call(left: float) -> str:
        calls.append(left)
        raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))

    with pytest.raises(KafkaUnavailableError, match="waiting for the partitions"):
        _admin()._answered("waiting for the partitions of new topics", call)
    assert len(calls) == 1


def _answers_for(seconds: float, code: int) -> Callable[[float], str]:
    """A call whose broker answers `code` for `seconds`, then is ready."""
    until = time.monotonic() + seconds

    def call(left: float) -> str:
        if time.monotonic() < until:
            raise KafkaException(KafkaError(code))
        return "ready"

    return call


def test_a_broker_that_answers_not_ready_is_waited_for_past_a_short_timeout() -> None:
    # A one-off command's 10 s is for a broker that does not answer. One that answers "not the leader" is
    # there and busy (a loaded broker created a bench's topics' partitions more than 10 s after CreateTopics
    # in CI): it is waited for longer.
    admin = Admin(Settings(bootstrap_servers="127.0.0.1:1", kafka_timeout=0.2))
    call = _answers_for(1.0, KafkaError.NOT_LEADER_FOR_PARTITION)
    assert admin._answered("waiting for the partitions of new topics", call) == "ready"


def test_a_broker_that_does_not_answer_is_reported_after_the_timeout() -> None:
    admin = Admin(Settings(bootstrap_servers="127.0.0.1:1", kafka_timeout=0.2))
    with pytest.raises(KafkaUnavailableError, match="waiting for the partitions"):
        admin._answered("waiting for the partitions of new topics", _answers_for(5.0, KafkaError._TRANSPORT))
