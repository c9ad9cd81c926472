"""Which offsets are safe to commit when work finishes out of order: the contiguous low-watermark."""

from __future__ import annotations

from collections import deque
from typing import Protocol

PartitionKey = tuple[str, int]


class Located(Protocol):
    """Where a message sits: a :class:`schemas.Position`, or the :class:`connectors.sources.Message` itself."""

    @property
    def stream(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...


class OffsetTracker:
    """Per partition: offsets handed out, offsets finished, and the next offset whose every
    predecessor is finished. Only that watermark is ever written or committed, so a crash can
    redeliver finished work (a no-op) but never skip unfinished work."""

    def __init__(self) -> None:
        self._dispatched: dict[PartitionKey, deque[int]] = {}
        self._done: dict[PartitionKey, set[int]] = {}
        self._next: dict[PartitionKey, int] = {}
        self._dirty: set[PartitionKey] = set()
        #: Bumped when a partition is forgotten, so work dispatched before cannot complete after.
        self._epoch: dict[PartitionKey, int] = {}

    def dispatch(self, position: Located) -> int:
        """Records an offset as in flight and returns the token ``complete`` needs. Offsets of one
        partition must arrive in increasing order (until the partition is forgotten)."""
        key = (position.stream, position.partition)
        queue = self._dispatched.get(key)
        if queue is None:
            queue = self._dispatched[key] = deque()
        queue.append(position.offset)
        return self._epoch.get(key, 0)

    def complete(self, position: Located, epoch: int = 0) -> None:
        """Marks an offset finished; a no-op for work dispatched before its partition was forgotten."""
        key = (position.stream, position.partition)
        queue = self._dispatched.get(key)
        if queue is None or epoch != self._epoch.get(key, 0):
            return
        if not queue or queue[0] != position.offset:
            # Finished out of order: the watermark waits for the offsets before it.
            self._done.setdefault(key, set()).add(position.offset)
            return
        offset = queue.popleft()
        done = self._done.get(key)
        while done and queue and queue[0] in done:
            done.discard(offset := queue.popleft())
        self._next[key] = offset + 1
        self._dirty.add(key)

    def take_watermarks(self) -> dict[PartitionKey, int]:
        """Next offsets of the partitions that moved since the last call."""
        moved = {key: self._next[key] for key in self._dirty}
        self._dirty.clear()
        return moved

    def forget(self, key: PartitionKey) -> None:
        """Drops a partition (revoked in a rebalance): its in-flight offsets will be redelivered, and
        work dispatched before this call can no longer move its watermark."""
        for table in (self._dispatched, self._done, self._next):
            table.pop(key, None)  # type: ignore[attr-defined]
        self._dirty.discard(key)
        self._epoch[key] = self._epoch.get(key, 0) + 1

    @property
    def moved(self) -> bool:
        """Whether a watermark moved since the last ``take_watermarks``."""
        return bool(self._dirty)

    @property
    def in_flight(self) -> int:
        return sum(len(q) for q in self._dispatched.values())
