"""Apache Kafka as a source on confluent-kafka (librdkafka): ``KafkaSource``'s semantics, a faster client.

Chosen with ``KafkaSource(client="confluent")`` or ``ETL_KAFKA_CLIENT=confluent`` (``pip install
'idem-etl[confluent]'``); kafka-python stays the default. The same contract as ``KafkaSource``:
offsets are never auto-committed; each assigned partition is read from the position stored in the
database (else the group's committed offset, else the beginning), set explicitly in the assignment;
Kafka commits follow each store transaction; a full runner pauses its partitions and polls only to
stay in the group, handing on anything a poll returns; dead letters are published and acknowledged
before the store records them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import structlog

from connectors.sources.base import Message, PartitionKey, PartitionLedger
from connectors.sources.kafka import KafkaSource, KafkaUnavailable
from schemas import DeadLetter

log = structlog.get_logger("connectors.kafka")

#: kafka-python's settings (what ``consumer_config`` and the runner pass) with no librdkafka twin.
_KAFKA_PYTHON_ONLY = {"max_poll_records", "api_version", "api_version_auto_timeout_ms", "consumer_timeout_ms"}


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """kafka-python's names (``session_timeout_ms``) as librdkafka's (``session.timeout.ms``);
    names with a dot are librdkafka's already."""
    return {(key if "." in key else key.replace("_", ".")): value for key, value in config.items()
            if key not in _KAFKA_PYTHON_ONLY}


class ConfluentKafkaSource(KafkaSource):
    """``KafkaSource`` on confluent-kafka; construct it as a ``KafkaSource``."""

    client_in_use = "confluent"

    def __init__(self, topic: str, **kwargs: Any) -> None:
        kwargs.pop("client", None)
        super().__init__(topic, client="confluent", **kwargs)
        #: Per partition: the next offset this member hands on (set on assignment, moved by each
        #: message returned); a replay or an ``until_end`` member is done when it reaches ``_end``.
        self._next: dict[tuple[str, int], int] = {}
        self._end_at: dict[tuple[str, int], int] = {}

    def open(self, ledger: PartitionLedger) -> None:
        from confluent_kafka import Consumer, KafkaException  # noqa: PLC0415

        if not self.bootstrap:
            raise KafkaUnavailable("no Kafka bootstrap server: pass bootstrap= or set ETL_KAFKA_BOOTSTRAP")
        config = {"auto.offset.reset": "earliest", **_config(self.consumer_config),
                  "bootstrap.servers": self.bootstrap, "enable.auto.commit": False,
                  "enable.auto.offset.store": False, "group.id": self.group or f"etl-replay-{time.time_ns()}"}
        try:
            self.consumer = consumer = Consumer(config)
        except KafkaException as exc:
            raise KafkaUnavailable(f"confluent-kafka refused the consumer settings: {exc}") from exc
        # A worker started while the broker restarts waits for it, as the runner waits for the store.
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                if self.replay_from is None:  # a group member waits for its topic, as kafka-python's does
                    consumer.list_topics(timeout=5)
                    break
                topic = consumer.list_topics(self.topic, timeout=5).topics[self.topic]
                if topic.error is None and topic.partitions:
                    partitions = topic.partitions
                    break
                consumer.close()
                self.consumer = None
                raise KafkaUnavailable(f"topic {self.topic!r} does not exist on {self.bootstrap}")
            except KafkaException as exc:
                if time.monotonic() >= deadline:
                    consumer.close()
                    self.consumer = None
                    raise KafkaUnavailable(f"cannot reach Kafka at {self.bootstrap} for {self.connect_timeout_s:.0f} s: "
                                           f"{exc}; is the broker up?") from exc
                log.warning("kafka_unavailable", bootstrap=self.bootstrap, error=str(exc)[:200])
            time.sleep(1.0)
        if self.replay_from is not None:
            self._assign_for_replay(sorted(partitions))
            return

        # the incremental protocol hands over only what moves (cooperative-sticky); eager, the whole assignment
        cooperative = "cooperative" in str(config.get("partition.assignment.strategy", ""))

        def assigned(consumer: Any, tps: list[Any]) -> None:
            for tp in tps:
                tp.offset = self._start_of(consumer, tp, ledger.stored_position(tp.topic, tp.partition))
                self._next[(tp.topic, tp.partition)] = tp.offset
                log.info("partition_assigned", stream=tp.topic, partition=tp.partition, stored_position=tp.offset)
            if cooperative:
                consumer.incremental_assign(tps)
            else:
                consumer.assign(tps)

        def revoked(consumer: Any, tps: list[Any]) -> None:
            keys = [(tp.topic, tp.partition) for tp in tps]
            for key in keys:
                self._next.pop(key, None)
                self._end_at.pop(key, None)
            if keys:
                log.info("partitions_revoked", partitions=sorted(keys))
                ledger.revoked(keys)
            if cooperative:
                consumer.incremental_unassign(tps)
            else:
                consumer.unassign()

        consumer.subscribe([self.topic], on_assign=assigned, on_revoke=revoked, on_lost=revoked)

    def _start_of(self, consumer: Any, tp: Any, stored: int | None) -> int:
        """Where a partition is read from: the stored position, else the group's commit, else the
        beginning (``auto.offset.reset=earliest``), as an offset (set in the assignment)."""
        if stored is not None:
            return stored
        committed = consumer.committed([tp], timeout=10)[0].offset
        return committed if committed >= 0 else consumer.get_watermark_offsets(tp, timeout=10)[0]

    def _assign_for_replay(self, partitions: Sequence[int]) -> None:  # type: ignore[override]
        from confluent_kafka import TopicPartition  # noqa: PLC0415

        consumer = self.consumer
        assert consumer is not None
        tps = [TopicPartition(self.topic, p) for p in partitions]
        for tp in tps:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            self._end_at[(tp.topic, tp.partition)] = high
            tp.offset = low
        if isinstance(self.replay_from, datetime):
            wanted = consumer.offsets_for_times(
                [TopicPartition(self.topic, p, int(self.replay_from.timestamp() * 1000)) for p in partitions], timeout=10)
            for tp, found in zip(tps, wanted, strict=True):
                tp.offset = found.offset if found.offset >= 0 else self._end_at[(tp.topic, tp.partition)]
        for tp in tps:
            self._next[(tp.topic, tp.partition)] = tp.offset
        consumer.assign(tps)

    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        from confluent_kafka import KafkaException  # noqa: PLC0415

        consumer = self.consumer
        assert consumer is not None, "open() first"
        try:
            if max_records == 0:
                # The runner is full: as KafkaSource, wait briefly, then pause and poll only to stay in
                # the group; a partition assigned meanwhile is not paused, and what it returns is handed on.
                if time.monotonic() - self._last_poll < self.keepalive_s:
                    return []
                if not self._paused:
                    consumer.pause(consumer.assignment())
                    self._paused = True
                self._last_poll = time.monotonic()
                return self._messages(consumer.consume(num_messages=500, timeout=0))
            if self._paused:
                consumer.resume(consumer.assignment())
                self._paused = False
            if self._replayed():
                return None
            self._last_poll = time.monotonic()
            return self._messages(consumer.consume(num_messages=max_records, timeout=timeout_s))
        except KafkaException as exc:
            log.warning("poll_failed", error=str(exc)[:200])
            return []

    def _messages(self, batch: Sequence[Any]) -> list[Message]:  # type: ignore[override]
        out = []
        for record in batch:
            if record.error() is not None:
                log.warning("kafka_message_error", error=str(record.error())[:200])
                continue
            key = (record.topic(), record.partition())
            self._next[key] = record.offset() + 1
            headers = record.headers()
            out.append(Message(value=record.value() or b"", key=record.key(),
                               headers=tuple((k, v or b"") for k, v in headers) if headers else (),
                               stream=record.topic(), partition=record.partition(), offset=record.offset()))
        return out

    def reading(self) -> bool:
        return self.consumer is not None and bool(self.consumer.assignment())

    def _replayed(self) -> bool:
        consumer = self.consumer
        assert consumer is not None
        if self.replay_from is None and not self.until_end:
            return False
        if self.replay_from is None:  # until_end: each partition up to its end when first assigned
            assigned = consumer.assignment()
            for tp in assigned:
                key = (tp.topic, tp.partition)
                if key not in self._end_at:
                    self._end_at[key] = consumer.get_watermark_offsets(tp, timeout=10)[1]
            if not assigned:
                return False
            keys = [(tp.topic, tp.partition) for tp in assigned]
        else:
            keys = list(self._end_at)
        return all(self._next.get(key, 0) >= self._end_at[key] for key in keys)

    def commit(self, positions: Mapping[PartitionKey, int]) -> None:
        from confluent_kafka import KafkaException, TopicPartition  # noqa: PLC0415

        if self.group is None or self.replay_from is not None or self.consumer is None or not positions:
            return
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        offsets = [TopicPartition(topic, partition, offset) for (topic, partition), offset in positions.items()
                   if (topic, partition) in assigned]
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Harmless: the stored positions rule; a new owner reads from them.
            log.warning("kafka_commit_failed", error=str(exc)[:200])

    def publish_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        from confluent_kafka import KafkaException, Producer  # noqa: PLC0415

        if not self.dlq_topic or not letters:
            return
        if self._producer is None:
            self._producer = Producer({"bootstrap.servers": self.bootstrap, "acks": "all", "linger.ms": 5})
        failures: list[str] = []

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                failures.append(str(error))

        try:
            for letter in letters:
                value, headers = letter.payload, [
                    ("reason", letter.reason.encode()),
                    ("detail", letter.detail.encode()[:1000]),
                    ("source", json.dumps(letter.position.model_dump()).encode()),
                ]
                if letter.tenant:
                    headers.append(("tenant", letter.tenant.encode()[:1000]))
                if len(value) > self.dlq_max_bytes:
                    value = value[: self.dlq_max_bytes]
                    headers.append(("truncated", str(len(letter.payload)).encode()))
                self._producer.produce(self.dlq_topic, value=value, headers=headers, on_delivery=delivered)
            left = self._producer.flush(60)
        except (KafkaException, BufferError) as exc:
            raise KafkaUnavailable(f"cannot publish dead letters to {self.dlq_topic}: {exc}") from exc
        if left or failures:
            raise KafkaUnavailable(f"cannot publish dead letters to {self.dlq_topic}: "
                                   f"{failures[0] if failures else f'{left} not acknowledged in 60 s'}")

    @property
    def replay_end(self) -> dict[PartitionKey, int] | None:
        return None if self.replay_from is None else dict(self._end_at)

    def end_offsets(self) -> dict[PartitionKey, int]:
        if self.consumer is None:
            return {}
        return {(tp.topic, tp.partition): self.consumer.get_watermark_offsets(tp, timeout=10)[1]
                for tp in self.consumer.assignment()}

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()  # leaves the group; with auto-commit off it commits nothing
            self.consumer = None
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None
