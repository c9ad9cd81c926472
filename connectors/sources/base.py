"""The Source contract: messages with positions in, positions committed back.

Lifecycle: ``open`` once, then ``poll`` until it returns ``None`` (finite sources) or the run is
stopped, ``commit`` after each store transaction, ``close`` at the end. ``close`` is not guaranteed
to be called (a crash skips it); nothing may depend on it for correctness, because the store, not the
source, is the record of how far each partition was processed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from schemas import Position

#: (stream, partition) → the next offset to read, as stored in the database.
PartitionKey = tuple[str, int]
PositionLookup = Callable[[str, int], int | None]


@dataclass(frozen=True)
class Message:
    """Raw bytes as the source delivered them, with the source's key and headers."""

    value: bytes
    position: Position
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = field(default=())


class Source(ABC):
    """Where messages come from. ``value_format`` tells the decoder how to read ``Message.value``."""

    value_format: Literal["json", "text"] = "json"
    #: A replay source re-reads from the start; the store keeps it from costing or writing anything.
    name: str = "source"

    def open(self, stored_position: PositionLookup) -> None:  # noqa: B027 - optional hook
        """Called once before the first poll. Partitioned sources seek each partition they are given
        to ``stored_position(stream, partition)`` (None: never processed). A failure aborts the run
        before anything is read."""

    @abstractmethod
    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        """Returns up to ``max_records`` messages (possibly none yet), or ``None`` once a finite
        source is exhausted. ``max_records == 0`` means the runner is full: keep any group
        membership alive but deliver nothing. Offsets within one partition arrive in order."""

    def commit(self, positions: Mapping[PartitionKey, int]) -> None:  # noqa: B027 - optional hook
        """Called after the store committed results up to ``positions`` (next offsets). An
        optimisation only: if it fails or never happens, the stored positions still rule."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases files or connections. Not guaranteed to be called."""
