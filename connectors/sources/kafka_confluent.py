"""Apache Kafka as a source on confluent-kafka (librdkafka): ``KafkaSource``'s semantics, a faster client.

Chosen with ``KafkaSource(client="confluent")`` or ``ETL_KAFKA_CLIENT=confluent`` (``pip install
'idem-etl[confluent]'``); kafka-python stays the default. The same contract as ``KafkaSource``:
offsets are never auto-committed; each assigned partition is read from the position stored in the
database (else the group's committed offset, else ``auto.offset.reset``), set in the assignment;
Kafka commits follow each store transaction; a full runner pauses its partitions and polls only to
stay in the group, handing on anything a poll returns; dead letters are published and acknowledged
before the store records them. Isolation is ``read_uncommitted`` unless configured, as kafka-python's.

A rebalance callback never raises into librdkafka (which would assign without the stored positions
and destroy the messages of that poll): its failure is kept and raised by the poll, so the run
stops with nothing committed past what it handed on. Fatal client errors stop the run too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import structlog

from connectors.sources.base import Message, PartitionKey, PartitionLedger
from connectors.sources.kafka import KafkaSource, KafkaUnavailable, letter_record
from schemas import DeadLetter

log = structlog.get_logger("connectors.kafka")

#: kafka-python's settings with no librdkafka twin (dropped), and those named otherwise.
_KAFKA_PYTHON_ONLY = {"max_poll_records", "api_version", "api_version_auto_timeout_ms", "consumer_timeout_ms",
                      "request_timeout_ms"}
_RENAMED = {"fetch_max_wait_ms": "fetch.wait.max.ms", "ssl_cafile": "ssl.ca.location",
            "ssl_certfile": "ssl.certificate.location", "ssl_keyfile": "ssl.key.location",
            "ssl_password": "ssl.key.password", "sasl_plain_username": "sasl.username",
            "sasl_plain_password": "sasl.password", "isolation_level": "isolation.level"}
#: What the dead-letter producer needs of the consumer's settings to reach the same cluster.
_SECURITY = ("security.protocol", "sasl.", "ssl.")


def _config(config: Mapping[str, Any]) -> dict[str, Any]:
    """kafka-python's names (``session_timeout_ms``) as librdkafka's (``session.timeout.ms``);
    names with a dot are librdkafka's already and win over a translated one."""
    translated = {_RENAMED.get(key, key.replace("_", ".")): value for key, value in config.items()
                  if "." not in key and key not in _KAFKA_PYTHON_ONLY}
    translated.update({key: value for key, value in config.items() if "." in key})
    if translated.get("group.protocol") == "consumer":  # KIP-848: the broker owns these
        for key in ("session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy"):
            translated.pop(key, None)
    return translated


def _unavailable(what: str, exc: BaseException) -> KafkaUnavailable:
    return KafkaUnavailable(f"{what}: {exc}")


class ConfluentKafkaSource(KafkaSource):
    """``KafkaSource`` on confluent-kafka; construct it as a ``KafkaSource``."""

    client_in_use = "confluent"

    def __init__(self, topic: str, **kwargs: Any) -> None:
        kwargs.setdefault("client", "confluent")  # made directly: this client whatever the setting
        super().__init__(topic, **kwargs)
        #: Per partition: the next offset this member hands on (moved by each message and by each
        #: end-of-partition event); a replay or an ``until_end`` member is done when it reaches ``_end_at``.
        self._next: dict[tuple[str, int], int] = {}
        #: ``until_end``: each partition's end when this member was first given it (kept on revoke).
        self._end_at: dict[tuple[str, int], int] = {}
        self._rebalance_error: BaseException | None = None
        self._config: dict[str, Any] = {}

    def open(self, ledger: PartitionLedger) -> None:
        from confluent_kafka import Consumer, KafkaError, KafkaException  # noqa: PLC0415

        if not self.bootstrap:
            raise KafkaUnavailable("no Kafka bootstrap server: pass bootstrap= or set ETL_KAFKA_BOOTSTRAP")
        bounded = self.replay_from is not None or self.until_end
        self._config = config = {
            "auto.offset.reset": "earliest", "isolation.level": "read_uncommitted", **_config(self.consumer_config),
            "bootstrap.servers": self.bootstrap, "enable.auto.commit": False, "enable.auto.offset.store": False,
            # a bounded read learns where each partition ends from librdkafka's end-of-partition events
            "enable.partition.eof": bounded, "group.id": self.group or f"etl-replay-{time.time_ns()}",
            "logger": logging.getLogger("connectors.kafka.librdkafka")}
        try:
            self.consumer = consumer = Consumer(config)
        except KafkaException as exc:
            raise _unavailable("confluent-kafka refused the consumer settings", exc) from exc
        try:
            partitions = self._wait_for_broker(consumer, KafkaError)
            if self.replay_from is not None:
                self._assign_for_replay(sorted(partitions))
            else:
                self._subscribe(consumer, ledger, config)
        except BaseException:
            consumer.close()
            self.consumer = None
            raise

    def _wait_for_broker(self, consumer: Any, kafka_error: Any) -> list[int]:
        """A worker started while the broker restarts waits for it (``connect_timeout_s``), as the
        runner waits for the store; a replay needs its topic's partitions."""
        from confluent_kafka import KafkaException  # noqa: PLC0415

        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                if self.replay_from is None:  # a group member waits for its topic, as kafka-python's does
                    consumer.list_topics(timeout=5)
                    return []
                topic = consumer.list_topics(self.topic, timeout=5).topics[self.topic]
                if topic.error is None and topic.partitions:
                    return list(topic.partitions)
                if topic.error is not None and topic.error.code() == kafka_error.UNKNOWN_TOPIC_OR_PART:
                    raise KafkaUnavailable(f"topic {self.topic!r} does not exist on {self.bootstrap}")
                problem: str = str(topic.error)  # a leader moving (a broker restarting): wait
            except KafkaException as exc:
                problem = str(exc)
            if time.monotonic() >= deadline:
                raise KafkaUnavailable(f"cannot reach Kafka at {self.bootstrap} for {self.connect_timeout_s:.0f} s: "
                                       f"{problem}; is the broker up?")
            log.warning("kafka_unavailable", bootstrap=self.bootstrap, error=problem[:200])
            time.sleep(1.0)

    def _subscribe(self, consumer: Any, ledger: PartitionLedger, config: Mapping[str, Any]) -> None:
        from confluent_kafka import OFFSET_INVALID  # noqa: PLC0415

        # the incremental protocols hand over only what moves (cooperative-sticky, KIP-848's
        # consumer protocol); the eager one, the whole assignment
        cooperative = ("cooperative" in str(config.get("partition.assignment.strategy", ""))
                       or config.get("group.protocol") == "consumer")

        def assigned(consumer: Any, tps: list[Any]) -> None:
            try:
                for tp in tps:
                    stored = ledger.stored_position(tp.topic, tp.partition)
                    # nothing stored: the group's commit, else auto.offset.reset (librdkafka's own rule)
                    tp.offset = stored if stored is not None else OFFSET_INVALID
                    self._next[(tp.topic, tp.partition)] = stored if stored is not None else -1
                    log.info("partition_assigned", stream=tp.topic, partition=tp.partition, stored_position=stored)
            except BaseException as exc:  # noqa: BLE001 - raised by the next poll, never into librdkafka
                self._rebalance_error = exc
                for tp in tps:
                    tp.offset = OFFSET_INVALID
            if cooperative:
                consumer.incremental_assign(tps)
            else:
                consumer.assign(tps)

        def revoked(consumer: Any, tps: list[Any]) -> None:
            keys = [(tp.topic, tp.partition) for tp in tps]
            try:
                for key in keys:
                    self._next.pop(key, None)
                if keys:
                    log.info("partitions_revoked", partitions=sorted(keys))
                    ledger.revoked(keys)
            except BaseException as exc:  # noqa: BLE001
                self._rebalance_error = exc
            if cooperative:
                consumer.incremental_unassign(tps)
            else:
                consumer.unassign()

        from confluent_kafka import KafkaException  # noqa: PLC0415

        try:
            consumer.subscribe([self.topic], on_assign=assigned, on_revoke=revoked, on_lost=revoked)
        except KafkaException as exc:
            raise _unavailable(f"cannot subscribe to {self.topic!r}", exc) from exc

    def _assign_for_replay(self, partitions: Sequence[int]) -> None:  # type: ignore[override]
        from confluent_kafka import KafkaException, TopicPartition  # noqa: PLC0415

        consumer = self.consumer
        assert consumer is not None
        tps = [TopicPartition(self.topic, p) for p in partitions]
        try:
            for tp in tps:
                low, high = consumer.get_watermark_offsets(tp, timeout=10)
                self._end_at[(tp.topic, tp.partition)] = high
                tp.offset = low
            if isinstance(self.replay_from, datetime):
                wanted = consumer.offsets_for_times(
                    [TopicPartition(self.topic, p, int(self.replay_from.timestamp() * 1000)) for p in partitions],
                    timeout=10)
                for tp, found in zip(tps, wanted, strict=True):
                    if found.error is not None:
                        raise KafkaUnavailable(f"cannot find {self.replay_from} in {self.topic}[{tp.partition}]: "
                                               f"{found.error}")
                    tp.offset = found.offset if found.offset >= 0 else self._end_at[(tp.topic, tp.partition)]
            for tp in tps:
                self._next[(tp.topic, tp.partition)] = tp.offset
            consumer.assign(tps)
        except KafkaException as exc:
            raise _unavailable(f"cannot set up the replay of {self.topic!r}", exc) from exc

    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        from confluent_kafka import KafkaException  # noqa: PLC0415

        consumer = self.consumer
        assert consumer is not None, "open() first"
        try:
            if max_records == 0:
                # The runner is full: as KafkaSource, wait briefly, then pause and poll only to stay in
                # the group. Every partition is paused each time (one assigned since is not), and what
                # a poll returns is handed on, never dropped.
                if time.monotonic() - self._last_poll < self.keepalive_s:
                    return []
                consumer.pause(consumer.assignment())
                self._paused = True
                self._last_poll = time.monotonic()
                return self._checked(consumer.consume(num_messages=500, timeout=0))
            if self._paused:
                consumer.resume(consumer.assignment())
                self._paused = False
            if self._replayed():
                return None
            self._last_poll = time.monotonic()
            return self._checked(consumer.consume(num_messages=max_records, timeout=timeout_s))
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if self._rebalance_error is None and not (error is not None and getattr(error, "fatal", bool)()):
                log.warning("poll_failed", error=str(exc)[:200])
                return []
            raise _unavailable("the Kafka consumer failed", exc) from exc

    def _checked(self, batch: Sequence[Any]) -> list[Message]:
        """The messages of a poll, after a failed rebalance callback or a fatal error has stopped the run."""
        messages = self._messages(batch)
        if self._rebalance_error is not None:
            error, self._rebalance_error = self._rebalance_error, None
            raise KafkaUnavailable(f"a rebalance could not be handled ({type(error).__name__}: {str(error)[:200]}); "
                                   "stopping, so nothing is committed past what was read") from error
        return messages

    def _messages(self, batch: Sequence[Any]) -> list[Message]:  # type: ignore[override]
        from confluent_kafka import KafkaError  # noqa: PLC0415

        out = []
        for record in batch:
            error = record.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:  # the partition's end, as of now
                    key = (record.topic(), record.partition())
                    self._next[key] = max(self._next.get(key, -1), record.offset())
                    continue
                if error.fatal():
                    raise KafkaUnavailable(f"the Kafka consumer failed: {error}")
                log.warning("kafka_message_error", error=str(error)[:200])
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
        return all(self._next.get(key, -1) >= self._end_at[key] for key in keys)

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
            security = {k: v for k, v in self._config.items() if k.startswith(_SECURITY)}
            self._producer = Producer({**security, "bootstrap.servers": self.bootstrap, "acks": "all", "linger.ms": 5})
        failures: list[str] = []

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                failures.append(str(error))

        try:
            for letter in letters:
                value, headers = letter_record(letter, self.dlq_max_bytes)
                self._producer.produce(self.dlq_topic, value=value, headers=headers, on_delivery=delivered)
            left = self._producer.flush(60)
        except (KafkaException, BufferError) as exc:
            self._producer.purge()  # not sent later: the retry sends them again
            raise _unavailable(f"cannot publish dead letters to {self.dlq_topic}", exc) from exc
        if left or failures:
            self._producer.purge()
            raise KafkaUnavailable(f"cannot publish dead letters to {self.dlq_topic}: "
                                   f"{failures[0] if failures else f'{left} not acknowledged in 60 s'}")

    @property
    def replay_end(self) -> dict[PartitionKey, int] | None:
        return None if self.replay_from is None else dict(self._end_at)

    def end_offsets(self) -> dict[PartitionKey, int]:
        """End offsets of the assigned partitions (for lag) as the last fetches saw them: no round
        trip on the source's thread; a partition not fetched yet is left out."""
        from confluent_kafka import KafkaException  # noqa: PLC0415

        if self.consumer is None:
            return {}
        ends = {}
        try:
            for tp in self.consumer.assignment():
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
                if high >= 0:
                    ends[(tp.topic, tp.partition)] = high
        except KafkaException as exc:
            log.warning("kafka_end_offsets_failed", error=str(exc)[:200])
        return ends

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()  # leaves the group; with auto-commit off it commits nothing
            self.consumer = None
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None
