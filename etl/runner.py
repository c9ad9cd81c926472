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
import time
import uuid
from datetime import date, datetime, timezone
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from connectors.sources import Message, PartitionKey
from connectors.store import Batch, DocRef, DocumentOutcome, SqlStore, Store
from etl.errors import BadInput, ConfigError, SourceError, StoreError
from etl.execute import Executor, StagePlan, Tally
from etl.llm.base import LLM
from etl.log import get_logger
from etl.metrics import Metrics
from etl.peers import StorePeers
from etl.pipeline import Pipeline
from etl.settings import Settings
from etl.tenancy import TenantBudgets
from etl.tracker import OffsetTracker
from schemas import DeadLetter, Document, Position

T = TypeVar("T")
log = get_logger("etl.runner")


@dataclass
class RunStats:
    """Counts for one run; what the progress bar, the metrics and the summary table show."""

    messages: int = 0
    stage_runs: int = 0
    stored_hits: int = 0
    cache_hits: int = 0
    llm_calls: int = 0
    results_written: int = 0
    dead_letters: int = 0
    saved_cost: float = 0.0
    in_flight: int = 0
    started: float = 0.0
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Share of stage runs served without a model call (stored results, cache, single-flight)."""
        return (self.stored_hits + self.cache_hits) / self.stage_runs if self.stage_runs else 0.0

    def add(self, tally: Tally) -> None:
        self.stage_runs += tally.stage_runs
        self.stored_hits += tally.stored_hits
        self.cache_hits += tally.cache_hits
        self.llm_calls += tally.llm_calls
        self.saved_cost += tally.saved_cost


@dataclass
class _Pending:
    position: Position
    epoch: int
    ref: DocRef | None
    keys: list[str]
    task: asyncio.Task[Any] | None = None


def _transient(exc: BaseException) -> bool:
    """A database that is restarting or unreachable: worth waiting for, not worth crashing over."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


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
        peers = StorePeers(self._store, store, pipeline.name, self.worker_id, self.claim_lease_s) \
            if isinstance(store, SqlStore) else None
        plans: dict[str, list[StagePlan]] = {}

        def tenant_plans(tenant: str) -> list[StagePlan]:
            if tenant not in plans:
                model = pipeline.tenant_llms.get(tenant, llm)
                plans[tenant] = [StagePlan.of(stage, model) for stage in pipeline.stages_for(tenant)]
            return plans[tenant]

        budgets = TenantBudgets(pipeline.budgets, self._tokens_spent) if pipeline.budgets else None
        self.executor = Executor(tenant_plans, peers, max_attempts=settings.llm_max_attempts,
                                 max_retry_s=settings.llm_max_retry_s, repairs=settings.repairs,
                                 retry_dead_letters=replaying_dead_letters, budgets=budgets, review=pipeline.review)
        self.tracker = OffsetTracker()
        self.stats = RunStats()
        # Look-ups, claims and the (one at a time) commits overlap on a server database; SQLite
        # takes one writer at a time anyway.
        parallel = isinstance(store, SqlStore) and store.engine.dialect.name != "sqlite"
        self._db = ThreadPoolExecutor(max_workers=4 if parallel else 1, thread_name_prefix="store")
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="source")
        self._tasks: dict[asyncio.Task[tuple[DocumentOutcome, Tally]], _Pending] = {}
        #: Documents dispatched but not yet committed: a duplicate of one waits for it instead.
        self._live: dict[DocRef, tuple[str, asyncio.Task[Any]]] = {}
        self._done: list[tuple[DocumentOutcome, _Pending]] = []
        self._revoked: collections.deque[PartitionKey] = collections.deque()

        self._last_flush = 0.0
        self._stopping = False

    def stop(self) -> None:
        """Asks the loop to stop polling, finish in-flight work, commit, and return."""
        self._stopping = True

    # -- the store, on its own thread, patient with restarts -----------------------------------

    async def _store(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_transient), stop=stop_after_delay(self.store_retry_s),
                wait=wait_exponential(multiplier=0.2, max=5), reraise=True,
                before_sleep=lambda state: log.warning("store_unavailable", attempt=state.attempt_number),
            ):
                with attempt:
                    return await loop.run_in_executor(self._db, fn, *args)
        except SQLAlchemyError as exc:
            raise StoreError(f"store failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
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

    async def run(self) -> RunStats:
        source = self.pipeline.source
        self.stats.started = time.perf_counter()
        try:
            await self._store(self.store.prepare, self.pipeline.extract_tables)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if isinstance(self.store, SqlStore) and self.pipeline.review is not None:
            self.executor.seen_labels = await self._store(self.store.sampled_labels, self.pipeline.name)
        await self._source(source.open, self)
        self._last_flush = last_message = time.perf_counter()
        exhausted = False
        flushing: asyncio.Task[None] | None = None
        try:
            while True:
                if flushing is not None and flushing.done():
                    flushing.result()  # a failed commit stops the run; nothing after it was committed
                    flushing = None
                polled, room = 0, 0
                if not exhausted and not self._stopping:
                    # In flight = dispatched and not yet committed, so a crash loses at most this much.
                    room = self.max_in_flight - len(self._tasks) - len(self._done)
                    busy = bool(self._tasks or self._done)
                    timeout = 0.0 if room <= 0 else 0.005 if busy else self.poll_timeout_s
                    messages = await self._source(source.poll, max(room, 0), timeout)
                    while self._revoked:
                        self.tracker.forget(self._revoked.popleft())
                    if messages is None:
                        exhausted = True
                    elif messages:
                        polled = len(messages)
                        last_message = time.perf_counter()
                        await self._dispatch(messages)
                    elif (self.idle_stop_s is not None and not self._tasks
                          and time.perf_counter() - last_message >= self.idle_stop_s):
                        exhausted = True  # an endless source that has gone quiet: stop, as asked
                if self._tasks:
                    # Poll again at once while there is room and messages flow; otherwise wait a little.
                    wait = 0 if polled and room > polled else 0.05
                    waitables: set[asyncio.Future[Any]] = {*self._tasks, *([flushing] if flushing else [])}
                    done, _ = await asyncio.wait(waitables, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task is not flushing:
                            self._finish(task)  # type: ignore[arg-type]
                finished = (exhausted or self._stopping) and not self._tasks
                if finished:
                    if flushing is not None:
                        await flushing
                    if self._done:
                        await self._flush()
                    break
                # Full: commit to make room, but in batches of a sixteenth of the window, not one by one.
                full = (len(self._tasks) + len(self._done) >= self.max_in_flight
                        and len(self._done) >= max(1, self.max_in_flight // 64))
                if flushing is None and self._done and (
                        full or len(self._done) >= self.flush_size
                        or time.perf_counter() - self._last_flush >= self.flush_interval_s):
                    # Commits run beside the loop, so the model keeps working while the store writes.
                    flushing = asyncio.create_task(self._flush())
        finally:
            for task in self._tasks:
                task.cancel()
            if flushing is not None and not flushing.done():
                await asyncio.wait([flushing])
            await asyncio.get_running_loop().run_in_executor(self._io, source.close)
            self._db.shutdown(wait=True)
            self._io.shutdown(wait=True)
        self.stats.elapsed_s = time.perf_counter() - self.stats.started
        return self.stats

    async def _dispatch(self, messages: list[Message]) -> None:
        self.stats.messages += len(messages)
        value_format = self.pipeline.source.value_format
        decoded: list[tuple[Document, Message, int]] = []
        bad: list[tuple[BadInput, Message, int]] = []
        for message in messages:
            epoch = self.tracker.dispatch(message.position)
            try:
                decoded.append((self.pipeline.decoder.decode(message, value_format), message, epoch))
            except BadInput as exc:
                bad.append((exc, message, epoch))
        keys = [self.executor.keys(doc) for doc, _, _ in decoded]
        lookup = await self._store(
            self.store.lookup, self.pipeline.name, [(d.tenant, d.key) for d, _, _ in decoded],
            [key for doc_keys in keys for key in doc_keys],
            [(m.position.stream, m.position.partition, m.position.offset) for _, m, _ in bad],
        )
        for exc, message, epoch in bad:
            p = message.position
            outcome = DocumentOutcome(document=None)
            if self.executor.retry_dead_letters or (p.stream, p.partition, p.offset) not in lookup.dead_positions:
                outcome = DocumentOutcome(document=None, dead_letter=DeadLetter(
                    position=p, reason=exc.reason, detail=str(exc), payload=message.value))
                log.warning("dead_letter", reason=exc.reason, stream=p.stream, partition=p.partition, offset=p.offset)
            self._done.append((outcome, _Pending(p, epoch, None, [])))
            self.tracker.complete(p, epoch)
        for (doc, message, epoch), doc_keys in zip(decoded, keys, strict=True):
            ref = (doc.tenant, doc.key)
            live = self._live.get(ref)
            if live is not None and live[0] == doc.content_hash:
                # The same document is already in flight or awaiting commit (a redelivery within
                # this run): wait for it, then complete this position with nothing to write.
                task = asyncio.create_task(self._after(live[1]))
                self._tasks[task] = _Pending(message.position, epoch, None, [])
                continue
            stored = self.executor.try_stored(doc, lookup, doc_keys)
            if stored is not None:  # a redelivery: done without a task
                self.stats.add(stored[1])
                self._done.append((stored[0], _Pending(message.position, epoch, None, [])))
                self.tracker.complete(message.position, epoch)
                continue
            task = asyncio.create_task(self.executor.run(doc, message.value, lookup, doc_keys))
            self._tasks[task] = _Pending(message.position, epoch, ref, doc_keys, task)
            self._live[ref] = (doc.content_hash, task)
        self.stats.in_flight = len(self._tasks)

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

    @staticmethod
    async def _after(task: asyncio.Task[Any]) -> tuple[DocumentOutcome, Tally]:
        await asyncio.wait([task])
        return DocumentOutcome(document=None), Tally()

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
        batch = Batch(outcomes=[outcome for outcome, _ in done],
                      positions=positions if self.pipeline.source.records_positions else {})
        letters = [o.dead_letter for o in batch.outcomes if o.dead_letter is not None]
        if letters:
            await self._source(self.pipeline.source.publish_dead_letters, letters)
        await self._store(self.store.write, self.pipeline.name, batch)
        await self._source(self.pipeline.source.commit, batch.positions)
        self._last_flush = time.perf_counter()
        for outcome, pending in done:
            self.stats.results_written += len(outcome.results)
            self.stats.dead_letters += outcome.dead_letter is not None
            if pending.ref is not None and self._live.get(pending.ref, ("", None))[1] is pending.task:
                del self._live[pending.ref]
            self.executor.flights.forget(pending.keys)
        log.debug("flushed", pipeline=self.pipeline.name, outcomes=len(done), positions=len(batch.positions))
        if self.metrics is not None:
            await self._report(batch)
        if self.on_progress is not None:
            self.on_progress(self.stats)
