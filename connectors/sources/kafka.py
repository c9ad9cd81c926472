"""Apache Kafka as a source (kafka-python): a consumer group member whose positions live in the store.

Offsets are never auto-committed. On assignment each partition is sought to the position stored in
the database (the source of truth); Kafka commits follow each store transaction and only save a
fresh consumer the trouble of a replay. Dead letters are published to a DLQ topic before the store
records them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import structlog
from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from connectors.sources.base import Message, PartitionKey, PartitionLedger, Source, SourceUnavailable
from schemas import DeadLetter

log = structlog.get_logger("connectors.kafka")


def letter_record(letter: DeadLetter, max_bytes: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    """A dead letter as a DLQ message (either client): its original bytes, cut to ``max_bytes``
    with a ``truncated`` header holding their full length, and reason, detail, position and
    tenant in headers."""
    value, headers = letter.payload, [
        ("reason", letter.reason.encode()),
        ("detail", letter.detail.encode()[:1000]),
        ("source", json.dumps(letter.position.model_dump()).encode()),
    ]
    if letter.tenant:
        headers.append(("tenant", letter.tenant.encode()[:1000]))
    if len(value) > max_bytes:
        value = value[:max_bytes]
        headers.append(("truncated", str(len(letter.payload)).encode()))
    return value, headers


class KafkaUnavailable(SourceUnavailable):
    """The broker could not be reached or refused the request (translated to SourceError by etl)."""


class _Rebalance(ConsumerRebalanceListener):
    """Seeks newly assigned partitions to their stored positions; reports revoked ones."""

    def __init__(self, source: KafkaSource, ledger: PartitionLedger) -> None:
        self.source = source
        self.ledger = ledger

    def on_partitions_revoked(self, revoked: Any) -> None:
        keys = [(tp.topic, tp.partition) for tp in revoked]
        if keys:
            log.info("partitions_revoked", partitions=sorted(keys))
            self.ledger.revoked(keys)

    def on_partitions_assigned(self, assigned: Any) -> None:
        consumer = self.source.consumer
        assert consumer is not None
        for tp in assigned:
            stored = self.ledger.stored_position(tp.topic, tp.partition)
            if stored is not None:
                consumer.seek(tp, stored)
            log.info("partition_assigned", stream=tp.topic, partition=tp.partition, stored_position=stored)


class KafkaSource(Source):
    """Consumes ``topic`` in consumer group ``group``.

    Args:
        topic: The topic to read.
        group: The consumer group; workers sharing it share the partitions.
        bootstrap: ``host:port``; None takes the ``ETL_KAFKA_BOOTSTRAP`` setting at run time.
        replay_from: ``"start"`` or a datetime: read every partition from there to the end offsets
            seen at start, outside the group (no Kafka commits), then stop. Stored results make it free.
        until_end: In the group, from the stored positions, read each partition up to the end offset it
            had when this member was first given it, then stop (``etl run --batch`` sets it: a backfill
            of what the topic holds now).
        dlq_topic: Where dead letters go (default ``<topic>.dlq``); None keeps them in the table only.
        consumer_config: Extra kafka-python consumer settings (session_timeout_ms, ...).
        value_format: ``"json"`` objects (default), ``"text"``, or ``"file"``: each message carries a
            file's bytes (PDF, HTML, text, Markdown; the message key is the document key, a
            ``tenant`` header its tenant).
        client: ``"kafka-python"`` (the default) or ``"confluent"`` (librdkafka, ``pip install
            'idem-etl[confluent]'``); None takes the ``ETL_KAFKA_CLIENT`` setting at run time.
    """

    def __init__(self, topic: str, *, group: str | None = None, bootstrap: str | None = None,
                 replay_from: Literal["start"] | datetime | None = None, dlq_topic: str | None | Literal[""] = "",
                 consumer_config: Mapping[str, Any] | None = None, until_end: bool = False,
                 value_format: Literal["json", "text", "file"] = "json",
                 client: Literal["kafka-python", "confluent"] | None = None) -> None:
        if client not in (None, "kafka-python", "confluent"):
            raise ValueError(f"KafkaSource client={client!r}: 'kafka-python' or 'confluent'")
        if group is None and replay_from is None:
            raise ValueError("KafkaSource needs group= (or replay_from= for a one-off replay)")
        self.topic = topic
        self.name = topic
        self.value_format = value_format
        self.group = group
        self.bootstrap = bootstrap
        self.replay_from = replay_from
        self.until_end = until_end
        self.dlq_topic = f"{topic}.dlq" if dlq_topic == "" else dlq_topic
        self.consumer_config = dict(consumer_config or {})
        #: None: the ``ETL_KAFKA_CLIENT`` setting at run time (``with_client``).
        self.client = client
        self.consumer: Any = None
        self._producer: KafkaProducer | None = None
        self._paused = False
        self._last_poll = time.monotonic()
        #: Longest the consumer goes unpolled while the runner is full (far below max.poll.interval.ms).
        self.keepalive_s = 5.0
        #: How long ``open`` keeps trying to reach the broker (one restarting) before it gives up.
        self.connect_timeout_s = 60.0
        #: Largest dead-letter value published whole (below Kafka's default 1 MiB message limits).
        self.dlq_max_bytes = 900_000
        #: The end offsets a replay (or an ``until_end`` member) reads up to.
        self._end: dict[TopicPartition, int] = {}

    def open(self, ledger: PartitionLedger) -> None:
        if not self.bootstrap:
            raise KafkaUnavailable("no Kafka bootstrap server: pass bootstrap= or set ETL_KAFKA_BOOTSTRAP")
        config: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "max_poll_records": 500,
            **self.consumer_config,
        }
        # A worker started while the broker restarts waits for it, as the runner waits for the store.
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                if self.replay_from is not None:
                    self.consumer = KafkaConsumer(group_id=None, **config)
                    self._assign_for_replay()
                else:
                    self.consumer = KafkaConsumer(group_id=self.group, **config)
                    self.consumer.subscribe([self.topic], listener=_Rebalance(self, ledger))
                return
            except KafkaError as exc:
                if self.consumer is not None:
                    self.consumer.close()
                    self.consumer = None
                if time.monotonic() >= deadline:
                    raise KafkaUnavailable(f"cannot reach Kafka at {self.bootstrap} for {self.connect_timeout_s:.0f} s: "
                                           f"{type(exc).__name__}; is the broker up?") from exc
                log.warning("kafka_unavailable", bootstrap=self.bootstrap, error=type(exc).__name__)
                time.sleep(1.0)

    def _assign_for_replay(self) -> None:
        consumer = self.consumer
        assert consumer is not None
        partitions = consumer.partitions_for_topic(self.topic)
        if not partitions:
            raise KafkaUnavailable(f"topic {self.topic!r} does not exist on {self.bootstrap}")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        self._end = consumer.end_offsets(tps)
        if self.replay_from == "start":
            consumer.seek_to_beginning(*tps)
        else:
            assert isinstance(self.replay_from, datetime)
            wanted = consumer.offsets_for_times({tp: int(self.replay_from.timestamp() * 1000) for tp in tps})
            for tp in tps:
                found = wanted.get(tp)
                consumer.seek(tp, found.offset if found is not None else self._end[tp])

    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        consumer = self.consumer
        assert consumer is not None, "open() first"
        if max_records == 0:
            # The runner is full. Briefly, do nothing: pausing drops what the consumer prefetched.
            # Once full for a while (a slow model), pause the partitions and keep polling, so the
            # group keeps this member well within max.poll.interval.ms.
            if time.monotonic() - self._last_poll < self.keepalive_s:
                return []
            # Every partition paused each time (one assigned since is not); one assigned inside this
            # very poll can still return records: they are handed on, never dropped (the tracker
            # sees only what poll returns, and would commit past a dropped record).
            self._last_poll = time.monotonic()
            try:
                consumer.pause(*consumer.assignment())
                self._paused = True
                return self._messages(consumer.poll(timeout_ms=0))
            except KafkaError as exc:
                log.warning("poll_failed", error=type(exc).__name__)
                return []
        if self._paused:
            consumer.resume(*consumer.paused())
            self._paused = False
        try:
            if self._replayed():
                return None
            self._last_poll = time.monotonic()
            batch = consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except KafkaError as exc:
            log.warning("poll_failed", error=type(exc).__name__)
            return []
        return self._messages(batch)

    @staticmethod
    def _messages(batch: Mapping[Any, Sequence[Any]]) -> list[Message]:
        return [
            Message(
                value=record.value if record.value is not None else b"",
                key=record.key,
                headers=tuple((k, v or b"") for k, v in record.headers) if record.headers else (),
                stream=record.topic,
                partition=record.partition,
                offset=record.offset,
            )
            for records in batch.values()
            for record in records
        ]

    def reading(self) -> bool:
        return self.consumer is not None and bool(self.consumer.assignment())

    def _replayed(self) -> bool:
        """A replay (or an ``until_end`` member) that has read every partition up to its end offset
        (checked before polling, so the last poll does not wait out its timeout for messages that
        will not come)."""
        consumer = self.consumer
        assert consumer is not None
        if self.replay_from is not None:
            return all(consumer.position(tp) >= end for tp, end in self._end.items())
        if not self.until_end:
            return False
        assigned = consumer.assignment()  # a member without partitions yet has not started
        fresh = [tp for tp in assigned if tp not in self._end]
        if fresh:  # first seen: read up to where it ends now (a KafkaError here is retried by poll)
            self._end.update(consumer.end_offsets(fresh))
        return bool(assigned) and all(consumer.position(tp) >= self._end[tp] for tp in assigned)

    def commit(self, positions: Mapping[PartitionKey, int]) -> None:
        if self.group is None or self.replay_from is not None or self.consumer is None or not positions:
            return
        assigned = self.consumer.assignment()
        offsets = {
            tp: OffsetAndMetadata(offset, "", -1)
            for (topic, partition), offset in positions.items()
            if (tp := TopicPartition(topic, partition)) in assigned
        }
        if not offsets:
            return
        try:
            self.consumer.commit(offsets)
        except KafkaError as exc:
            # Harmless: the stored positions rule; a new owner seeks to them.
            log.warning("kafka_commit_failed", error=type(exc).__name__)

    @property
    def dead_letter_channel(self) -> bool:  # type: ignore[override]
        return bool(self.dlq_topic)

    def publish_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        """Sends each letter (its original bytes, reason and position in headers) and waits for every
        acknowledgement; raises if any was refused. A payload over ``dlq_max_bytes`` (the broker's
        and producer's default limits are ~1 MiB) is cut to that size, with a ``truncated`` header
        holding its full length: the full bytes stay in the ``dead_letters`` table."""
        if not self.dlq_topic or not letters:
            return
        if self._producer is None:
            self._producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5)
        try:
            sent = []
            for letter in letters:
                value, headers = letter_record(letter, self.dlq_max_bytes)
                sent.append(self._producer.send(self.dlq_topic, value=value, headers=headers))
            self._producer.flush(timeout=60)
            for future in sent:
                future.get(timeout=60)  # flush() does not raise for a record the broker refused
        except KafkaError as exc:
            raise KafkaUnavailable(f"cannot publish dead letters to {self.dlq_topic}: {type(exc).__name__}") from exc

    @property
    def replay_end(self) -> dict[PartitionKey, int] | None:
        """For a replay: the end offsets it reads up to."""
        return None if self.replay_from is None else {(tp.topic, tp.partition): end for tp, end in self._end.items()}

    def end_offsets(self) -> dict[PartitionKey, int]:
        """End offsets of the partitions assigned now (for lag)."""
        if self.consumer is None:
            return {}
        assigned = list(self.consumer.assignment())
        ends = self.consumer.end_offsets(assigned) if assigned else {}
        return {(tp.topic, tp.partition): end for tp, end in ends.items()}

    #: The client this class drives (``ConfluentKafkaSource``: "confluent").
    client_in_use = "kafka-python"

    def like(self, cls: type[KafkaSource] | None = None, **changes: Any) -> KafkaSource:
        """A source with this one's settings and ``changes``, of ``cls`` (default: this one's class;
        ``etl.runtime.wiring.with_client`` picks the client's)."""
        args = {"group": self.group, "bootstrap": self.bootstrap, "replay_from": self.replay_from,
                "dlq_topic": self.dlq_topic, "consumer_config": self.consumer_config, "until_end": self.until_end,
                "value_format": self.value_format, "client": self.client, **changes}
        made = (cls or type(self))(self.topic, **args)
        made.keepalive_s, made.connect_timeout_s, made.dlq_max_bytes = (
            self.keepalive_s, self.connect_timeout_s, self.dlq_max_bytes)
        return made

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close(autocommit=False)
            self.consumer = None
        if self._producer is not None:
            self._producer.close(timeout=10)
            self._producer = None
