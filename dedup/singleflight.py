"""In-process single-flight: concurrent requests for one key share one computation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """Coalesces concurrent calls by key within one event loop.

    The first caller for a key runs the computation; callers arriving while it runs await the same
    result (or the same exception). Finished results stay until :meth:`forget`, so a duplicate that
    arrives after the first finished but before its result was committed is still served without a
    second call; the runner forgets keys once they are durable in the store.
    """

    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Future[T]] = {}

    async def do(self, key: str, compute: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Returns (result, shared): ``shared`` is True when another caller did the work."""
        flight = self._flights.get(key)
        if flight is not None:
            return await asyncio.shield(flight), True
        flight = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        try:
            result = await compute()
        except BaseException as exc:
            # Failures are not remembered: the next caller may try again (only validated outputs
            # are ever cached). Callers already waiting share this failure.
            del self._flights[key]
            if not flight.done():
                flight.set_exception(exc)
                flight.exception()  # mark retrieved: nobody else may be waiting
            raise
        flight.set_result(result)
        return result, False

    def forget(self, keys: Iterable[str]) -> None:
        """Drops finished results for ``keys`` once they are durable in the store."""
        for key in keys:
            flight = self._flights.get(key)
            if flight is not None and flight.done():
                del self._flights[key]

    def __contains__(self, key: str) -> bool:
        """Whether a call for ``key`` now would share another's computation (running, or finished
        and not forgotten) rather than run its own."""
        return key in self._flights

    def __len__(self) -> int:
        return len(self._flights)
