"""The Source contract: messages with positions in, positions committed back.

Lifecycle: ``open`` once, then ``poll`` until it returns ``None`` (finite sources) or the run is
stopped, ``commit`` after each store transaction, ``close`` at the end. ``close`` is not guaranteed
to be called (a crash skips it); nothing may depend on it for correctness, because the store, not the
source, is the record of how far each partition was processed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas import DeadLetter, Position

#: (stream, partition)
PartitionKey = tuple[str, int]


class SourceUnavailable(RuntimeError):
    """The source cannot be opened or read (a missing file, an unreachable broker): the run stops
    with this one line (``etl`` translates it to ``SourceError``)."""


class PartitionLedger(Protocol):
    """What a partitioned source needs from the runner during rebalances."""

    def stored_position(self, stream: str, partition: int) -> int | None:
        """The next offset to read, from the database; None if never processed."""

    def revoked(self, partitions: Collection[PartitionKey]) -> None:
        """Partitions taken away: their in-flight work is abandoned, never committed by us."""


@dataclass(slots=True)
class Message:
    """Raw bytes as the source delivered them, where they sit (``stream``, ``partition``,
    ``offset``, as in :class:`Position`), and the source's key and headers. Read-only by convention:
    not frozen, because a source makes one per message and a replay makes millions."""

    value: bytes
    stream: str
    offset: int
    partition: int = 0
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = field(default=())

    @property
    def position(self) -> Position:
        """Where the message sits, as the record the schemas carry (made when asked: a redelivery
        that is already stored never needs one)."""
        return Position(stream=self.stream, partition=self.partition, offset=self.offset)


class Source(ABC):
    """Where messages come from. ``value_format`` tells the decoder how to read ``Message.value``
    (``json`` objects, ``text``, or the bytes of a ``file``: PDF, HTML, text, Markdown)."""

    value_format: Literal["json", "text", "file"] = "json"
    name: str = "source"
    #: False for sources that re-read old positions (dead-letter replay): never store their positions.
    records_positions: bool = True
    #: Whether ``publish_dead_letters`` sends letters somewhere (a DLQ topic).
    dead_letter_channel: bool = False

    def open(self, ledger: PartitionLedger) -> None:  # noqa: B027 - optional hook
        """Called once before the first poll. Partitioned sources seek each partition they are given
        to ``ledger.stored_position`` and report revocations to ``ledger.revoked`` (both are called
        from inside ``poll``). A failure aborts the run before anything is read."""

    @abstractmethod
    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        """Returns up to ``max_records`` messages (possibly none yet), or ``None`` once a finite
        source is exhausted. ``max_records == 0`` means the runner is full: keep any group
        membership alive but deliver nothing. Offsets within one partition arrive in order."""

    def reading(self) -> bool:
        """Whether the source has something to read from now. A Kafka member without partitions (still
        joining its group, or waiting for the topic's metadata) is not: idle time does not count."""
        return True

    def commit(self, positions: Mapping[PartitionKey, int]) -> None:  # noqa: B027 - optional hook
        """Called after the store committed results up to ``positions`` (next offsets). An
        optimisation only: if it fails or never happens, the stored positions still rule."""

    def publish_dead_letters(self, letters: Sequence[DeadLetter]) -> None:  # noqa: B027 - optional hook
        """Called, for a source with ``dead_letter_channel``, with dead letters *after* the store
        transaction that recorded them (an outbox: the table is the record); they are marked
        published once this returns. Raise if any letter was not accepted: they stay pending and are
        sent again. Sources without a channel keep them in the table only."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases files or connections. Not guaranteed to be called."""
