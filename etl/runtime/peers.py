"""Single-flight across workers, through the store: claims and cache look-ups for the executor.

Requests made in the same turn of the event loop share one store round trip, so a burst of cache
misses costs one claim statement, not one per key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from connectors.store import CacheEntry, Lookup, SqlStore

StoreCall = Callable[..., Awaitable[Any]]
Fetch = Callable[[list[str]], Awaitable[dict[str, Any]]]


class StorePeers:
    """The executor's :class:`etl.runtime.execute.Peers`, on a :class:`SqlStore` shared by every worker."""

    def __init__(self, call: StoreCall, store: SqlStore, pipeline: str, worker_id: str, lease_s: float) -> None:
        self._call = call  # the runner's store call: its thread pool, its retries of restarts
        self._store = store
        self._pipeline = pipeline
        self._worker_id = worker_id
        self._lease_s = lease_s
        self._claims: dict[str, asyncio.Future[bool]] = {}
        self._cached: dict[str, asyncio.Future[CacheEntry | None]] = {}
        self._background: set[asyncio.Future[None]] = set()

    async def claim(self, key: str) -> bool:
        return await self._batched(self._claims, key, self._claim_many)  # type: ignore[no-any-return]

    async def cached(self, key: str) -> CacheEntry | None:
        return await self._batched(self._cached, key, self._cached_many)  # type: ignore[no-any-return]

    async def _claim_many(self, keys: list[str]) -> dict[str, bool]:
        claimed = await self._call(self._store.claim_many, keys, self._worker_id, self._lease_s)
        return {key: key in claimed for key in keys}

    async def _cached_many(self, keys: list[str]) -> dict[str, CacheEntry | None]:
        found: Lookup = await self._call(self._store.lookup, self._pipeline, [], keys)
        return {key: found.cache.get(key) for key in keys}

    async def _batched(self, pending: dict[str, asyncio.Future[Any]], key: str, fetch: Fetch) -> Any:
        future = pending.get(key)
        if future is None:
            future = pending[key] = asyncio.get_running_loop().create_future()
            if len(pending) == 1:  # the first request of this turn schedules the round trip
                asyncio.get_running_loop().call_soon(self._spawn, self._drain(pending, fetch))
        return await asyncio.shield(future)

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        """A background task, held until done (the loop keeps only weak references to tasks)."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _drain(pending: dict[str, asyncio.Future[Any]], fetch: Fetch) -> None:
        batch = dict(pending)
        pending.clear()
        try:
            answers = await fetch(list(batch))
        except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
            for future in batch.values():
                if not future.done():
                    future.set_exception(exc)
            return
        for key, future in batch.items():
            if not future.done():
                future.set_result(answers[key])
