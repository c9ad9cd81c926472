"""The loop: poll → decode → run stages concurrently → commit results and positions together.

Ordering that keeps the promise:
1. Before any LLM call, the store is asked what it already has for the polled documents; a stored
   result with the same cache key makes that stage a no-op (a redelivery costs nothing).
2. Before calling the model for a key, a worker claims it in the store; other workers wait for the
   result instead of paying twice (single-flight across processes).
3. Dead letters are published (DLQ topic), then results, cache entries, call records, dead letters
   and the positions they complete are written in one transaction. Positions are the contiguous
   low-watermark per partition, so work that finished out of order is never skipped by a crash.
4. Only after that commit is the source told (Kafka offsets); losing that step only means a
   redelivery, which step 1 makes free.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import gc
import time
import uuid
from collections.abc import Callable, Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from connectors.sources import Message, PartitionKey
from connectors.store import (
    Batch,
    CacheEntry,
    DocRef,
    DocumentOutcome,
    Lookup,
    SqlStore,
    Store,
    Version,
    is_transient,
)
from connectors.store.evolve import MigrationNeeded
from etl.errors import BadInput, ConfigError, SourceError, StoreError
from etl.health import Probe
from etl.llm.base import LLM
from etl.log import get_logger
from etl.metrics import Metrics
from etl.pipeline import Pipeline
from etl.quality.router import Students
from etl.runtime.decode import Decoded
from etl.runtime.calls import plans_by_tenant
from etl.runtime.execute import Executor, ModelCalls, StagePlan, Tally
from etl.runtime.peers import StorePeers
from etl.runtime.stats import RunStats
from etl.runtime.tracker import OffsetTracker
from etl.runtime.versions import Route, route
from etl.settings import Settings
from etl.tenancy import TenantBudgets
from schemas import DeadLetter, Document, Position

T = TypeVar("T")
F = TypeVar("F", bound="asyncio.Future[Any]")
log = get_logger("etl.runtime.runner")


@dataclass
class _Pending:
    position: Position
    epoch: int
    ref: DocRef | None
    keys: list[str]
    task: asyncio.Task[Any] | None = None
    #: Holds one of the window's slots (model work started), given back when its outcome commits.
    slot: bool = False
    #: Keys whose results the document already held (stored, or in flight): not counted as written.
    restated: frozenset[str] = frozenset()


@dataclass
class _Polled:
    """A polled batch with its tracker epochs, queued for the store look-up in poll order. Decoded
    and checked for redeliveries (``Store.unsettled``) when polled, so the check of one batch runs
    on the store's thread while the batches before it are settled."""
    messages: list[Message]
    epochs: list[int]
    decoded: list[tuple[Decoded, Message, int, list[str]]] = dataclasses.field(default_factory=list)
    bad: list[tuple[BadInput, Message, int]] = dataclasses.field(default_factory=list)
    unsettled: asyncio.Task[set[DocRef]] | None = None


class Runner:
    """Runs one pipeline against one store with one model until the source ends or :meth:`stop`."""

    def __init__(self, pipeline: Pipeline, store: Store, llm: LLM, settings: Settings, *,
                 idle_stop_s: float | None = None, replaying_dead_letters: bool = False,
                 on_progress: Callable[[RunStats], None] | None = None, metrics: Metrics | None = None) -> None:
        self.pipeline = pipeline
        self.store = store
        self.llm = llm
        self.max_in_flight = settings.max_in_flight
        self.flush_size = settings.flush_size
        self.flush_interval_s = settings.flush_interval_s
        self.poll_timeout_s = 0.2
        self.claim_lease_s = settings.claim_lease_s
        self.store_retry_s = settings.store_retry_s
        self.idle_stop_s = idle_stop_s
        self.on_progress = on_progress
        self.metrics = metrics
        self._reported = (0, 0)  # (messages, hits) already counted in metrics
        self._lag_checked = 0.0
        self.worker_id = uuid.uuid4().hex[:16]
        self._peers = peers = StorePeers(self._store, store, pipeline.name, self.worker_id, self.claim_lease_s) \
            if isinstance(store, SqlStore) else None
        # One plan list per configured tenant and one shared by every other: tenants that come from
        # messages cost no memory each.
        configured = plans_by_tenant(pipeline, llm, settings.repairs)
        default = configured.pop("")

        def tenant_plans(tenant: str) -> list[StagePlan]:
            return configured.get(tenant, default)

        budgets = TenantBudgets(pipeline.budgets, self._tokens_spent) if pipeline.budgets else None
        calls = ModelCalls(peers, max_attempts=settings.llm_max_attempts, max_retry_s=settings.llm_max_retry_s,
                           repairs=settings.repairs, budgets=budgets)
        # the default stages' routers last: their checks' settings win; a tenant's own stage says
        # whether it is routed and at what shadow rate
        routers = {stage.name: stage.router for stages in (*pipeline.tenant_stages.values(), pipeline.stages)
                   for stage in stages if getattr(stage, "router", None) is not None}
        #: Students of the routed stages (loaded at start, refreshed as the routers say).
        self.students = Students(store.engine, pipeline.name, routers) if routers and isinstance(store, SqlStore) \
            else None
        self.executor = Executor(tenant_plans, calls, retry_dead_letters=replaying_dead_letters, review=pipeline.review,
                                 students=self.students)
        self.tracker = OffsetTracker()
        self.stats = RunStats()
        # Look-ups, claims and the (one at a time) commits overlap on a server database; SQLite
        # takes one writer at a time anyway.
        parallel = isinstance(store, SqlStore) and store.engine.dialect.name != "sqlite"
        self._db = ThreadPoolExecutor(max_workers=4 if parallel else 1, thread_name_prefix="store")
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="source")
        self._tasks: dict[asyncio.Task[tuple[DocumentOutcome, Tally]], _Pending] = {}
        #: Documents dispatched but not yet committed: a duplicate of one waits for it instead.
        self._live: dict[DocRef, tuple[str, asyncio.Task[Any], Version]] = {}
        self._done: list[tuple[DocumentOutcome, _Pending]] = []
        self._revoked: collections.deque[PartitionKey] = collections.deque()

        #: Set whenever a poll, look-up, document task or commit finishes: the loop's one wait.
        self._wake = asyncio.Event()
        #: Document tasks finished and not yet taken by the loop, in completion order.
        self._completed: collections.deque[asyncio.Task[tuple[DocumentOutcome, Tally]]] = collections.deque()
        #: The window: a slot per document with model work started and not yet committed.
        self._slots = asyncio.Semaphore(self.max_in_flight)
        #: Polled batches waiting for the store look-up, in order.
        self._queued: collections.deque[_Polled] = collections.deque()
        #: Largest poll: half the window, so one batch can be polled while another is looked up.
        self._batch = max(1, self.max_in_flight // 2)
        #: Messages polled and still queued, decoded or looked up (in flight too).
        self._incoming = 0
        #: Whether the last batch was mostly documents already stored (then the next is checked
        #: with ``Store.unsettled`` before anything else is looked up).
        self._mostly_redeliveries = True
        #: Stored outputs are read only when a when= predicate may need them.
        self._with_outputs = any(stage.when is not None for stages in (pipeline.stages, *pipeline.tenant_stages.values())
                                 for stage in stages)
        self._last_flush = 0.0
        self._stopping = False
        self._looping = False  # start-up is over: the loop has begun
        #: Told each turn of the loop that it turned, and whether the source has partitions
        #: (``etl.health``: what /healthz and /readyz answer).
        self.probe: Probe | None = None

    def _start(self, work: Coroutine[Any, Any, tuple[DocumentOutcome, Tally]], pending: _Pending
               ) -> asyncio.Task[tuple[DocumentOutcome, Tally]]:
        """A document task; when it finishes it queues itself for the loop and wakes it."""
        pending.task = task = asyncio.create_task(work)
        self._tasks[task] = pending
        task.add_done_callback(self._completed.append)
        task.add_done_callback(lambda _: self._wake.set())
        return task

    def _watch(self, future: F) -> F:
        """Wakes the loop when ``future`` finishes."""
        future.add_done_callback(lambda _: self._wake.set())
        return future

    def stop(self) -> None:
        """Asks the loop to stop polling, finish in-flight work, commit, and return."""
        self._stopping = True
        if self.probe is not None:
            self.probe.draining = True

    # -- the store, on its own thread, patient with restarts -----------------------------------

    async def _store(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        patience = stop_after_delay(self.store_retry_s)
        try:
            async for attempt in AsyncRetrying(
                # Patient while running (a commit waits out a restart), but a stop during start-up
                # (nothing read yet) is not kept waiting for a store that may never come back.
                retry=retry_if_exception(is_transient),
                stop=lambda state: patience(state) or (self._stopping and not self._looping),
                wait=wait_exponential(multiplier=0.2, max=5), reraise=True,
                before_sleep=lambda state: log.warning(
                    "store_unavailable", attempt=state.attempt_number,
                    error=str(state.outcome.exception() if state.outcome else "").splitlines()[0][:200]),
            ):
                with attempt:
                    return await loop.run_in_executor(self._db, fn, *args)
        except SQLAlchemyError as exc:
            cause = f"{type(exc).__name__}: {str(exc.orig if isinstance(exc, DBAPIError) else exc).splitlines()[0]}"
            if is_transient(exc):
                raise StoreError(f"store unavailable for {self.store_retry_s:g} s (ETL_STORE_RETRY_S): {cause}") from exc
            raise StoreError(f"store refused, and retrying cannot help: {cause}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _source(self, fn: Callable[..., T], *args: Any) -> T:
        """Source calls run on one thread (a Kafka consumer is not thread-safe); their own failures
        are translated here."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        except (OSError, RuntimeError) as exc:
            raise SourceError(str(exc)) from exc

    async def _tokens_spent(self, tenant: str, day: date) -> int:
        if not isinstance(self.store, SqlStore):
            return 0
        since = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
        return await self._store(self.store.tokens_spent, tenant, since)

    # PartitionLedger: called by the source from inside poll.
    def stored_position(self, stream: str, partition: int) -> int | None:
        return self.store.stored_position(self.pipeline.name, stream, partition)

    def revoked(self, partitions: Collection[PartitionKey]) -> None:
        self._revoked.extend(partitions)

    # -- the loop ------------------------------------------------------------------------------

    async def _start_up(self) -> None:
        """The store migrated and read, the source opened: before the loop's first turn."""
        try:
            await self._store(self.store.prepare, self.pipeline.extract_tables)
        except MigrationNeeded as exc:
            raise ConfigError(exc.for_target(self.pipeline.origin or "PIPELINE")) from exc
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if isinstance(self.store, SqlStore) and self.pipeline.review is not None:
            self.executor.seen_labels = await self._store(self.store.sampled_labels, self.pipeline.name)
        if self.students is not None:
            await self._store(self.students.load)
        await self._source(self.pipeline.source.open, self)

    async def run(self) -> RunStats:
        source = self.pipeline.source
        self.stats.started = time.perf_counter()
        try:
            await self._start_up()
        except StoreError:
            if self._stopping:  # stopped while waiting for the store: nothing was read, nothing to do
                log.warning("stopped_during_start_up")
                self.stats.elapsed_s = time.perf_counter() - self.stats.started
                return self.stats
            raise
        if source.dead_letter_channel:
            await self._publish_pending()  # letters a crash left between the commit and the channel
        self._looping = True
        self._last_flush = last_message = last_keepalive = time.perf_counter()
        exhausted = False
        polling: asyncio.Future[list[Message] | None] | None = None
        dispatching: asyncio.Task[None] | None = None
        flushing: asyncio.Task[None] | None = None
        # What lives through the whole run (modules, models, connections) is not the collector's to
        # walk on every full collection; per-message garbage is. And with thousands of documents in
        # flight (a backfill's window), collections every 700 allocations walk the same live objects
        # again and again: a 20,000-document batch run took 28-29 s, 19-23 s with this threshold.
        gc.freeze()
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], 50_000), *threshold[1:])
        try:
            while True:
                if self.probe is not None:
                    self.probe.tick(source.reading())
                if flushing is not None and flushing.done():
                    flushing.result()  # a failed commit stops the run; nothing after it was committed
                    flushing = None
                while self._completed:
                    self._finish(self._completed.popleft())
                if polling is not None and polling.done():
                    messages = polling.result()
                    polling = None
                    while self._revoked:
                        self.tracker.forget(self._revoked.popleft())
                    if messages is None:
                        exhausted = True
                    elif messages:
                        last_message = time.perf_counter()
                        # Dispatched now, in poll order (a revocation from here on makes them stale);
                        # decoded and checked for redeliveries now, looked up one batch at a time.
                        self._queued.append(self._read(messages, [self.tracker.dispatch(m) for m in messages]))
                        self._incoming += len(messages)
                    elif not source.reading() and time.perf_counter() - self.stats.started < (self.idle_stop_s or 0) + 30:
                        last_message = time.perf_counter()  # joining a group is not being idle (for 30 s)
                    elif (self.idle_stop_s is not None and not self._tasks and dispatching is None and not self._queued
                          and time.perf_counter() - last_message >= self.idle_stop_s):
                        exhausted = True  # an endless source that has gone quiet: stop, as asked
                if dispatching is not None and dispatching.done():
                    dispatching.result()
                    dispatching = None
                if dispatching is None and self._queued:
                    dispatching = self._watch(asyncio.create_task(self._dispatch(self._queued.popleft())))
                if polling is None and not exhausted and not self._stopping:
                    # Up to a window of documents is read ahead of the window at work (decoded, looked
                    # up, waiting for a slot), so a freed slot starts the next call at once. Polls of
                    # at most half a window, so the next is fetched while the last is looked up; when
                    # full, an empty poll now and then keeps the group membership alive.
                    room = 2 * self.max_in_flight - len(self._tasks) - len(self._done) - self._incoming
                    if room > 0 or time.perf_counter() - last_keepalive >= 1.0:
                        polling = self._watch(asyncio.ensure_future(self._source(
                            source.poll, min(max(room, 0), self._batch), self.poll_timeout_s if room > 0 else 0.0)))
                        last_keepalive = time.perf_counter()
                if ((exhausted or self._stopping) and not self._tasks and polling is None and dispatching is None
                        and not self._queued):
                    if flushing is not None:
                        await flushing
                    if self._done or self.tracker.moved:
                        await self._flush()
                    break
                # Full: commit to make room, but in batches of a sixty-fourth of the window, not one by one.
                full = self._slots.locked() and len(self._done) >= max(1, self.max_in_flight // 64)
                if flushing is None and (self._done or self.tracker.moved) and (
                        full or len(self._done) >= self.flush_size
                        or time.perf_counter() - self._last_flush >= self.flush_interval_s):
                    # Commits run beside the loop, so the model keeps working while the store writes.
                    flushing = self._watch(asyncio.create_task(self._flush()))
                if not self._completed:
                    # Until a poll, look-up, task or commit finishes (each sets the event), or a while.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await self._wake.wait()
                self._wake.clear()
        finally:
            gc.unfreeze()
            gc.set_threshold(*threshold)
            for task in (*self._tasks, *([dispatching] if dispatching else [])):
                task.cancel()
            for polled in self._queued:  # checked ahead, never dispatched: a stop or a failure
                if polled.unsettled is not None:
                    polled.unsettled.cancel()
                    polled.unsettled.add_done_callback(lambda t: t.cancelled() or t.exception())
            for future in (polling, flushing):
                if future is not None and not future.done():
                    await asyncio.wait([future])
            await asyncio.get_running_loop().run_in_executor(self._io, source.close)
            self._db.shutdown(wait=True)
            if isinstance(self.store, SqlStore):
                self.store.dispose()  # its pooled connections end with the run, not at exit
            self._io.shutdown(wait=True)
        self.stats.elapsed_s = time.perf_counter() - self.stats.started
        return self.stats

    def _read(self, messages: list[Message], epochs: list[int]) -> _Polled:
        """A polled batch decoded, with each document's cache keys; while most documents turn out
        stored (a replay), its redelivery check is started too."""
        polled = _Polled(messages, epochs)
        value_format, decoder, executor = self.pipeline.source.value_format, self.pipeline.decoder, self.executor
        for message, epoch in zip(messages, epochs, strict=True):
            try:
                doc = decoder.read(message, value_format)
            except BadInput as exc:
                polled.bad.append((exc, message, epoch))
            else:
                polled.decoded.append((doc, message, epoch, executor.keys(doc)))
        if polled.decoded and self._mostly_redeliveries and not self._with_outputs:
            # Redeliveries first, without reading their rows: every stage stored for exactly its
            # key, at the message's own position. (With a when= predicate, which stages apply
            # depends on stored outputs.) Worth a round trip only while most documents turn out
            # stored. Checked ahead of the batches before it being settled: a check that misses a
            # write in between only sends its document the longer way, through ``lookup``.
            expected = [(doc.tenant, doc.key, stage, key) for doc, _, _, doc_keys in polled.decoded
                        for stage, key in zip(executor.stage_names(doc.tenant), doc_keys, strict=True)]
            at: dict[DocRef, Version] = {}
            for doc, m, _, _ in polled.decoded:  # a document twice in the batch: its newest position decides
                ref = (doc.tenant, doc.key)
                at[ref] = max(at.get(ref, (m.stream, m.partition, m.offset)), (m.stream, m.partition, m.offset))
            polled.unsettled = asyncio.ensure_future(self._store(self.store.unsettled, self.pipeline.name, expected, at))
        return polled

    async def _dispatch(self, polled: _Polled) -> None:
        """Settles what of a polled batch is already stored, looks up the rest and starts a task
        for every document that still has work."""
        try:
            await self._dispatch_batch(polled)
        finally:
            self._incoming -= len(polled.messages)

    async def _dispatch_batch(self, polled: _Polled) -> None:
        self.stats.messages += len(polled.messages)
        decoder, executor = self.pipeline.decoder, self.executor
        decoded, bad = polled.decoded, polled.bad
        documents, settled = len(decoded), 0
        if polled.unsettled is not None:
            unsettled = await polled.unsettled
            rest = []
            for item in decoded:
                doc, message, epoch, doc_keys = item
                if (doc.tenant, doc.key) in unsettled:
                    rest.append(item)
                else:
                    settled += 1
                    self._settle(message, epoch, len(doc_keys))
            decoded = rest
        self._mostly_redeliveries = settled * 2 >= documents
        if not decoded and not bad:
            return
        lookup = await self._store(
            functools.partial(self.store.lookup, outputs=self._with_outputs), self.pipeline.name,
            [(d.tenant, d.key) for d, _, _, _ in decoded],
            [key for d, _, _, doc_keys in decoded for key in (*doc_keys, *executor.alternates(d))],
            [(m.stream, m.partition, m.offset) for _, m, _ in bad],
        )
        for exc, message, epoch in bad:
            p = message.position
            outcome = DocumentOutcome(document=None)
            if executor.retry_dead_letters or (p.stream, p.partition, p.offset) not in lookup.dead_positions:
                outcome = DocumentOutcome(document=None, dead_letter=DeadLetter(
                    position=p, reason=exc.reason, detail=str(exc), payload=message.value))
                log.warning("dead_letter", reason=exc.reason, stream=p.stream, partition=p.partition, offset=p.offset)
            self._done.append((outcome, _Pending(p, epoch, None, [])))
            self.tracker.complete(p, epoch)
        # Outputs of results stored for an older position of the same content were not looked up
        # (a redelivery needs none); a newer copy takes them from the cache.
        stored_keys = {key for key, _ in lookup.results.values()}
        reused = [key for doc, m, _, doc_keys in decoded if (v := lookup.versions.get((doc.tenant, doc.key)))
                  and v < (m.stream, m.partition, m.offset) for key in (*doc_keys, *executor.alternates(doc))
                  if key in stored_keys]
        if reused:
            lookup.cache.update((await self._store(self.store.lookup, self.pipeline.name, [], reused)).cache)
            # A student's answer is a stored result and no cache entry: the newer copy keeps it
            # from the stored row (the row is not rewritten: its cache key is the same).
            if missing := set(reused) - lookup.cache.keys():
                refs = {(doc.tenant, doc.key) for doc, _, _, doc_keys in decoded
                        if missing.intersection((*doc_keys, *executor.alternates(doc)))}
                rows = (await self._store(functools.partial(self.store.lookup, outputs=True), self.pipeline.name,
                                          refs, [])).results
                lookup.held = {key: CacheEntry(key, tenant, stage, "", output, "stored result", 0, 0, 0.0)
                               for (tenant, _, stage), (key, output) in rows.items()
                               if key in missing and output is not None}
        for doc, message, epoch, doc_keys in decoded:
            ref = (doc.tenant, doc.key)
            at = (message.stream, message.partition, message.offset)
            live = self._live.get(ref)
            way = route(at, lookup.versions.get(ref), None if live is None else (live[0], live[2]), doc.content_hash)
            if way is Route.OLDER:
                self.stats.older_versions += 1
                settled += 1
                if executor.retry_dead_letters or ref in lookup.dead:
                    # An open dead letter of this version (a race, or a dlq replay) is superseded.
                    outcome = DocumentOutcome(document=decoder.document(doc, message), settles_dead_letters=True)
                    self._done.append((outcome, _Pending(message.position, epoch, None, [])))
                    self.tracker.complete(message, epoch)
                else:
                    self._settle(message, epoch, 0)
                continue
            if way is Route.WAIT:
                assert live is not None  # noqa: S101
                self._start(self._after(live[1], None), _Pending(message.position, epoch, None, []))
                continue
            if way is Route.RESTATE:
                assert live is not None  # noqa: S101
                self._live[ref] = (live[0], self._start(
                    self._after(live[1], (decoder.document(doc, message), message.value, doc_keys,
                                          lookup.for_newer_version(ref, ()))),
                    _Pending(message.position, epoch, ref, doc_keys,
                             restated=frozenset((*doc_keys, *executor.alternates(doc))))), at)
                continue
            if way is Route.STORED and (hits := executor.try_stored(doc, lookup, doc_keys)) is not None:
                settled += 1
                self._settle(message, epoch, hits)
                continue
            document = decoder.document(doc, message)
            looked_up = lookup.for_newer_version(ref, executor.stage_names(doc.tenant)) if way is Route.NEWER else lookup
            pending = _Pending(message.position, epoch, ref, doc_keys, slot=True, restated=looked_up.restated)
            self._live[ref] = (doc.content_hash, self._start(
                self._work(document, message.value, looked_up, doc_keys), pending), at)
        self._mostly_redeliveries = settled * 2 >= documents
        self.stats.in_flight = len(self._tasks)

    def _settle(self, message: Message, epoch: int, stage_runs: int) -> None:
        """A redelivery already stored: nothing to call or write, only its position to commit."""
        self.stats.stage_runs += stage_runs
        self.stats.stored_hits += stage_runs
        self.tracker.complete(message, epoch)

    async def _publish_pending(self) -> None:
        """Dead letters committed and not yet on the source's channel go out now, and are marked
        published in the store (after the commit: a crash in between can never lose them, and
        publishes them again at most for that one batch)."""
        try:
            await self._store(self.store.publish_pending, self.pipeline.name, self.pipeline.source.publish_dead_letters)
        except (OSError, RuntimeError) as exc:
            raise SourceError(str(exc)) from exc

    async def _report(self, batch: Batch) -> None:
        assert self.metrics is not None  # noqa: S101
        hits = self.stats.stored_hits + self.stats.cache_hits
        messages, reported_hits = self._reported
        self.metrics.committed(batch.outcomes, self.stats.messages - messages, hits - reported_hits,
                               len(self._tasks) + len(self._done))
        self._reported = (self.stats.messages, hits)
        end_offsets = getattr(self.pipeline.source, "end_offsets", None)
        if end_offsets is not None and time.perf_counter() - self._lag_checked > 5:
            self._lag_checked = time.perf_counter()
            ends = await self._source(end_offsets)
            name = self.pipeline.name
            stored = {key: await self._store(self.store.stored_position, name, *key) for key in ends}
            self.metrics.set_lag({key: end - (stored[key] or 0) for key, end in ends.items()})

    async def _work(self, document: Document, payload: bytes, lookup: Lookup,
                    keys: list[str]) -> tuple[DocumentOutcome, Tally]:
        """One document's stages, once a slot of the window is free: at most ``max_in_flight``
        documents have model work started and not yet committed, so a crash repeats at most that."""
        await self._slots.acquire()
        return await self.executor.run(document, payload, lookup, keys)

    async def _after(self, task: asyncio.Task[tuple[DocumentOutcome, Tally]],
                     newer: tuple[Document, bytes, list[str], Lookup] | None) -> tuple[DocumentOutcome, Tally]:
        """Waits for ``task``, this document's content in flight. Nothing to write, unless this is a
        ``newer`` copy: then that outcome again at this position, without its paid work (calls and
        cache entries are recorded once, by the first)."""
        await asyncio.wait([task])
        if newer is None or task.cancelled() or task.exception() is not None:
            return DocumentOutcome(document=None), Tally()
        document, payload, keys, older = newer
        outcome = task.result()[0]
        if outcome.document is None or outcome.letter_stands or (
                outcome.dead_letter is None and len(outcome.results) < len(outcome.stages)):
            # Nothing written, a letter left standing at the older position, or valid results kept
            # from the store that this task cannot restate (their rows may be another version's by
            # the time this commits): taken again from the flight or the cache (they are valid
            # answers: no call); what failed at the older position fails here too, without a call.
            restated = dataclasses.replace(older, cache={}, restated=frozenset(
                (*keys, *self.executor.alternates(document))) | older.restated)
            return await self.executor.run(document, payload, restated, keys)
        letter = outcome.dead_letter
        return dataclasses.replace(
            outcome, document=document, calls=(), cache=(), payload=payload, settles_dead_letters=True,
            dead_letter=None if letter is None else letter.model_copy(update={"position": document.position,
                                                                              "payload": payload}),
        ), Tally()

    def _finish(self, task: asyncio.Task[tuple[DocumentOutcome, Tally]]) -> None:
        pending = self._tasks.pop(task)
        outcome, tally = task.result()  # the executor turns every document failure into a dead letter
        self.stats.add(tally)
        self.stats.in_flight = len(self._tasks)
        self._done.append((outcome, pending))
        self.tracker.complete(pending.position, pending.epoch)
        if self.on_progress is not None:
            self.on_progress(self.stats)

    async def _flush(self) -> None:
        done, self._done = self._done, []
        positions = self.tracker.take_watermarks()
        source = self.pipeline.source
        batch = Batch(outcomes=[outcome for outcome, _ in done],
                      positions=positions if source.records_positions else {}, outbox=source.dead_letter_channel)
        await self._store(self.store.write, self.pipeline.name, batch)
        if batch.outbox and any(o.dead_letter is not None for o in batch.outcomes):
            await self._publish_pending()
        await self._source(source.commit, batch.positions)
        self._last_flush = time.perf_counter()
        if self.students is not None and (self.students.pending or self.students.due()):
            if self.students.pending:  # switch-offs are decided as checks come in; written here
                pending, self.students.pending = self.students.pending, []
                await self._store(self.students.flush, pending)
            await self._store(self.students.load)
        for outcome, pending in done:
            self.stats.results_written += sum(r.provenance.cache_key not in pending.restated for r in outcome.results)
            self.stats.dead_letters += outcome.dead_letter is not None
            if pending.ref is not None and self._live.get(pending.ref, ("", None))[1] is pending.task:
                del self._live[pending.ref]
            if pending.slot:
                self._slots.release()
            # a long document's chunks were claimed and flown under keys of their own (a fallback
            # model's answer is claimed and flown under the plan's key: ModelCalls.claim_or_wait)
            keys = [*pending.keys, *(row["cache_key"] for row in outcome.chunks), *(e.cache_key for e in outcome.cache)] \
                if outcome.chunks or outcome.cache else pending.keys
            self.executor.flights.forget(keys)
            if self._peers is not None:
                self._peers.release(keys)
        log.debug("flushed", pipeline=self.pipeline.name, outcomes=len(done), positions=len(batch.positions))
        if self.metrics is not None:
            await self._report(batch)
        if self.on_progress is not None:
            self.on_progress(self.stats)
