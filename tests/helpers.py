"""Small helpers for tests: row counts and table snapshots."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, inspect, text

CORE_TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "source_positions", "dead_letters")


def counts(url: str, tables: tuple[str, ...] = CORE_TABLES) -> dict[str, int]:
    engine = create_engine(url)
    try:
        names = set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in tables if t in names}
    finally:
        engine.dispose()


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]], partitions: int = 4) -> None:
    """Sends (key, value) pairs round-robin over the partitions, and waits for every ack."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    for i, (key, value) in enumerate(messages):
        producer.send(topic, key=key, value=value, partition=i % partitions)
    producer.flush(timeout=60)
    producer.close()


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        return {tp.partition: offset for tp, offset in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def read_all(bootstrap: str, topic: str) -> list[Any]:
    """Every record of a topic, from the start."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=3000)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        return list(consumer)
    finally:
        consumer.close()
