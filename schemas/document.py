"""The envelope every message becomes once decoded, and where it came from."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Position(BaseModel):
    """Where a message sits in its source: a Kafka (topic, partition, offset), or a file and line.

    ``stream`` names the topic or file; ``partition`` is 0 for sources without partitions;
    ``offset`` is the message's own offset, so the *next* position to read is ``offset + 1``.
    """

    model_config = ConfigDict(frozen=True)

    stream: str
    partition: int = 0
    offset: int


class Document(BaseModel):
    """A decoded message: who it belongs to, a stable key, and its content.

    The key must be stable across redeliveries (an ``id`` field, a Kafka key, a file name) because
    the result ledger is keyed on (pipeline, tenant, key, stage).
    """

    model_config = ConfigDict(frozen=True)

    tenant: str
    key: str
    content: str
    content_hash: str
    position: Position
    fields: dict[str, Any] = Field(default_factory=dict)
    received_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
