"""Which version of a document a polled message is, before anything is called or written.

A version is a position (stream, partition, offset): within a partition or a file a later offset is
newer. The rules here decide what a message needs; the store enforces the order again when it
writes (a version older than the stored one never replaces it), so a stale decision costs at most
work, never a regression.
"""

from __future__ import annotations

import enum

from connectors.store import Version


class Route(enum.Enum):
    #: Older than the stored version: nothing to call or write.
    OLDER = "older"
    #: This content of the document is in flight at this position or a newer one (a redelivery
    #: within the run, or an older copy): wait for it, write nothing.
    WAIT = "wait"
    #: This content is in flight at an older position: the newest version is that outcome again,
    #: at this position.
    RESTATE = "restate"
    #: Newer than the stored version, or another version is in flight: a version of its own, run
    #: from the cache, never settled against results of another position (even of the same content).
    NEWER = "newer"
    #: At the stored version's position (a redelivery), or a document never seen: stored results
    #: with exactly this message's keys make it a no-op.
    STORED = "stored"


def route(at: Version, stored: Version | None, live: tuple[str, Version] | None, content_hash: str) -> Route:
    """``stored``: the stored version's position; ``live``: (content hash, position) of the
    version of this document in flight in this run, if any."""
    if stored is not None and stored > at:
        return Route.OLDER
    if stored is not None and stored == at and (live is None or live[0] != content_hash):
        return Route.STORED  # a redelivery of the stored version: whatever else is in flight
    if live is not None and live[0] == content_hash:
        return Route.WAIT if at <= live[1] else Route.RESTATE
    if stored is not None or live is not None:
        return Route.NEWER
    return Route.STORED
