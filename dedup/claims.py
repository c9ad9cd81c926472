"""Cross-worker single-flight: a claim (a lease) on a cache key before paying for an LLM call."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Claims(ABC):
    """Leases on cache keys, shared by every worker on one store.

    The holder of a live claim is the only worker that calls the model for that key; the others wait
    for its result to appear in the cache. A claim expires after its lease, so a crashed holder never
    blocks the key for longer than that. Claims are released when the key's result (or dead letter)
    is committed.
    """

    @abstractmethod
    def claim(self, key: str, owner: str, lease_s: float) -> bool:
        """True if ``owner`` now holds the claim: it was free, expired, or already ``owner``'s."""
