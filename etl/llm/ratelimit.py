"""A client-side rate limit per provider: requests per second and tokens per minute."""

from __future__ import annotations

import asyncio
import time


class _Bucket:
    """A token bucket: ``rate`` units per second, holding at most ``capacity``."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.stamp = time.monotonic()

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` can be taken; takes it if that is 0."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        amount = min(amount, self.capacity)  # a request bigger than a minute's budget waits for a full bucket
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate


class RateLimit:
    """Waits before a request so that neither limit is exceeded. ``None`` disables a limit."""

    def __init__(self, requests_per_s: float | None = None, tokens_per_min: float | None = None) -> None:
        self._requests = _Bucket(requests_per_s, max(1.0, requests_per_s)) if requests_per_s else None
        self._tokens = _Bucket(tokens_per_min / 60, tokens_per_min) if tokens_per_min else None
        self._lock = asyncio.Lock()

    async def acquire(self, tokens: int) -> None:
        async with self._lock:
            for bucket, amount in ((self._requests, 1.0), (self._tokens, float(tokens))):
                if bucket is None:
                    continue
                while (delay := bucket.wait_for(amount)) > 0:
                    await asyncio.sleep(delay)
