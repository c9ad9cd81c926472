"""Quarantined messages as a source, for ``etl dlq replay``: the original bytes at their original
positions, so document keys (and so idempotency) are exactly those of the first delivery."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import Engine, select

from connectors.sources.base import Message, Source
from connectors.store.tables import dead_letters


class DeadLetterSource(Source):
    """Open dead letters of one pipeline (optionally one reason), oldest first."""

    #: Replayed messages are old positions: they must never move a stored position.
    records_positions = False

    def __init__(self, engine: Engine, pipeline: str, reason: str | None = None,
                 value_format: Literal["json", "text", "file"] = "json") -> None:
        self.engine = engine
        self.pipeline = pipeline
        self.reason = reason
        self.value_format = value_format
        self.name = f"dead letters of {pipeline}"
        self._after = 0

    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        if max_records == 0:
            return []
        query = select(dead_letters.c.id, dead_letters.c.payload, dead_letters.c.stream, dead_letters.c.partition,
                       dead_letters.c.message_offset).where(
            dead_letters.c.pipeline == self.pipeline, dead_letters.c.status == "open", dead_letters.c.id > self._after)
        if self.reason:
            query = query.where(dead_letters.c.reason == self.reason)
        with self.engine.connect() as conn:
            found = conn.execute(query.order_by(dead_letters.c.id).limit(max_records)).all()
        if not found:
            return None
        self._after = found[-1].id
        return [Message(value=bytes(r.payload), stream=r.stream, partition=r.partition, offset=r.message_offset)
                for r in found]
