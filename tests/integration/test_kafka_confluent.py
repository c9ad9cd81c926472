"""What only the confluent-kafka client needs (tests/integration/test_kafka.py runs the shared
contract with both): a rebalance callback that fails never lets a poll hand on, or librdkafka
drop, messages past a partition it could not position; the run stops instead."""

from __future__ import annotations

import time

import pytest

from connectors.sources.kafka import KafkaUnavailable
from connectors.sources.kafka_confluent import ConfluentKafkaSource, _config
from tests.helpers import produce


class _BrokenLedger:
    def stored_position(self, stream: str, partition: int) -> int | None:
        raise ConnectionError("the store went away")

    def revoked(self, partitions: list[tuple[str, int]]) -> None:
        pass


def test_a_failed_assignment_stops_the_poll_instead_of_reading_unpositioned(kafka_bootstrap: str, topic: str) -> None:
    produce(kafka_bootstrap, topic, [(None, b'{"id": "a", "text": "x"}')] * 40)
    source = ConfluentKafkaSource(topic, group=f"{topic}-g", bootstrap=kafka_bootstrap,
                                  consumer_config={"session_timeout_ms": 6000})
    source.open(_BrokenLedger())  # type: ignore[arg-type]
    try:
        deadline, handed = time.monotonic() + 60, []
        with pytest.raises(KafkaUnavailable, match="a rebalance could not be handled .*ConnectionError"):
            while time.monotonic() < deadline:
                handed += source.poll(100, 0.5) or []
        assert handed == []  # nothing read from a partition whose stored position was never asked
    finally:
        source.close()


def test_kafka_python_names_become_librdkafka_names_and_dotted_ones_win() -> None:
    assert _config({"session_timeout_ms": 6000, "session.timeout.ms": 60000, "max_poll_records": 500,
                    "ssl_cafile": "/ca.pem", "sasl_plain_username": "u"}) == {
        "session.timeout.ms": 60000, "ssl.ca.location": "/ca.pem", "sasl.username": "u"}
    assert "session.timeout.ms" not in _config({"session_timeout_ms": 6000, "group.protocol": "consumer"})
