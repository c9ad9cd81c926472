"""Single-flight across workers, through the store: claims and cache look-ups for the executor.

Requests made in the same turn of the event loop share one store round trip, so a burst of cache
misses costs one claim statement, not one per key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from connectors.store import CacheEntry, Lookup, SqlStore
from connectors.store.sql import HELD, MINE
from etl.log import get_logger

log = get_logger("etl.runtime.peers")
StoreCall = Callable[..., Awaitable[Any]]
Fetch = Callable[[list[str]], Awaitable[dict[str, Any]]]


class StorePeers:
    """The executor's :class:`etl.runtime.execute.Peers`, on a :class:`SqlStore` shared by every worker.

    Keys this worker claimed are held until their outcome commits (``release``): their leases are
    renewed every third of a lease in one statement, so a slow call never outlives its claim; a key
    whose renewal failed (a stall longer than the lease) is ``lost``.
    """

    def __init__(self, call: StoreCall, store: SqlStore, pipeline: str, worker_id: str, lease_s: float) -> None:
        self._call = call  # the runner's store call: its thread pool, its retries of restarts
        self._store = store
        self._pipeline = pipeline
        self._worker_id = worker_id
        self._lease_s = lease_s
        #: Longest pause between two looks at a key another worker holds: well inside a lease, so
        #: a holder's failure (kept until its lease ends) is seen.
        self.max_wait_s = min(1.0, lease_s / 4)
        self._claims: dict[str, asyncio.Future[str]] = {}
        self._cached: dict[str, asyncio.Future[CacheEntry | None]] = {}
        self._background: set[asyncio.Future[None]] = set()
        self._held: set[str] = set()
        #: Keys this worker found held by another: waiting for that holder's outcome.
        self._waiting: set[str] = set()
        self._lost: set[str] = set()
        self._renewing: asyncio.Task[None] | None = None

    async def claim(self, key: str) -> str:
        state: str = await self._batched(self._claims, key, self._claim_many)
        if state == HELD:
            self._waiting.add(key)
        else:
            self._waiting.discard(key)
        if state == MINE:
            self._held.add(key)
            self._lost.discard(key)
            if self._renewing is None or self._renewing.done():
                self._renewing = asyncio.ensure_future(self._renew())
        return state

    def lost(self, key: str) -> bool:
        return key in self._lost

    def release(self, keys: list[str]) -> None:
        """The keys' outcomes are committed (the claims are gone or carry the failure)."""
        self._held.difference_update(keys)
        self._lost.difference_update(keys)
        self._waiting.difference_update(keys)

    async def cached(self, key: str) -> CacheEntry | None:
        return await self._batched(self._cached, key, self._cached_many)  # type: ignore[no-any-return]

    async def _claim_many(self, keys: list[str]) -> dict[str, str]:
        return await self._call(self._store.claim_many, keys, self._worker_id, self._lease_s,  # type: ignore[no-any-return]
                                self._pipeline, self._waiting & set(keys))

    async def _cached_many(self, keys: list[str]) -> dict[str, CacheEntry | None]:
        found: Lookup = await self._call(self._store.lookup, self._pipeline, [], keys)
        return {key: found.cache.get(key) for key in keys}

    async def _renew(self) -> None:
        while self._held:
            await asyncio.sleep(self._lease_s / 3)
            keys = sorted(self._held - self._lost)
            if not keys:
                continue
            try:
                held = await self._call(self._store.renew_claims, keys, self._worker_id, self._lease_s)
            except Exception:  # noqa: BLE001 - the store is away: the next turn tries again
                continue
            lost = (set(keys) - held) & self._held  # released meanwhile: not lost
            if lost:
                log.warning("lease_lost", keys=len(lost))
                self._lost.update(lost)

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
