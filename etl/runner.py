"""The loop: poll → decode → run stages concurrently → commit results and positions together.

Ordering that keeps the promise:
1. Before any LLM call, the store is asked what it already has for the polled documents; a stored
   result with the same cache key makes that stage a no-op (a redelivery costs nothing).
2. Results, cache entries, call records, dead letters and the positions they complete are written
   in one transaction. Positions are the contiguous low-watermark per partition, so work that
   finished out of order is never skipped by a crash.
3. Only after that commit is the source told (Kafka offsets); losing that step only means a
   redelivery, which step 1 makes free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from connectors.sources import Message
from connectors.store import Batch, DocRef, DocumentOutcome, Store
from etl.errors import BadInput, ConfigError, StoreError
from etl.execute import Executor, StagePlan, Tally
from etl.llm.base import LLM
from etl.log import get_logger
from etl.pipeline import Pipeline
from etl.tracker import OffsetTracker
from schemas import DeadLetter, Document, Position

T = TypeVar("T")
log = get_logger("etl.runner")


@dataclass
class RunStats:
    """Counts for one run; what the progress bar and the summary table show."""

    messages: int = 0
    stage_runs: int = 0
    stored_hits: int = 0
    cache_hits: int = 0
    llm_calls: int = 0
    results_written: int = 0
    dead_letters: int = 0
    saved_cost: float = 0.0
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
    ref: DocRef | None
    keys: list[str]
    task: asyncio.Task[Any] | None = None


class Runner:
    """Runs one pipeline against one store with one model until the source ends or :meth:`stop`."""

    def __init__(self, pipeline: Pipeline, store: Store, llm: LLM, *, max_in_flight: int = 16,
                 flush_size: int = 200, flush_interval_s: float = 1.0, poll_timeout_s: float = 0.2,
                 on_progress: Callable[[RunStats], None] | None = None) -> None:
        self.pipeline = pipeline
        self.store = store
        self.llm = llm
        self.max_in_flight = max_in_flight
        self.flush_size = flush_size
        self.flush_interval_s = flush_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.on_progress = on_progress
        self.executor = Executor([StagePlan.of(s, llm) for s in pipeline.stages], llm)
        self.tracker = OffsetTracker()
        self.stats = RunStats()
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="source")
        self._tasks: dict[asyncio.Task[tuple[DocumentOutcome, Tally]], _Pending] = {}
        #: Documents dispatched but not yet committed: a duplicate of one waits for it instead.
        self._live: dict[DocRef, tuple[str, asyncio.Task[Any]]] = {}
        self._done: list[tuple[DocumentOutcome, _Pending]] = []
        self._last_flush = 0.0
        self._stopping = False

    def stop(self) -> None:
        """Asks the loop to stop polling, finish in-flight work, commit, and return."""
        self._stopping = True

    async def _store(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a store call on the store's own thread, translating database errors at the boundary."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)
        except SQLAlchemyError as exc:
            raise StoreError(f"store failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc

    async def run(self) -> RunStats:
        source = self.pipeline.source
        self.stats.started = time.perf_counter()
        try:
            await self._store(self.store.prepare, self.pipeline.extract_tables)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        name = self.pipeline.name
        source.open(lambda stream, partition: self.store.stored_position(name, stream, partition))
        self._last_flush = time.perf_counter()
        exhausted = False
        try:
            while True:
                polled = 0
                if not exhausted and not self._stopping:
                    room = self.max_in_flight - len(self._tasks)
                    messages = await asyncio.get_running_loop().run_in_executor(
                        self._io, source.poll, max(room, 0), self.poll_timeout_s if room > 0 else 0.0)
                    if messages is None:
                        exhausted = True
                    elif messages:
                        polled = len(messages)
                        await self._dispatch(messages)
                if self._tasks:
                    # Poll again at once while there is room and messages flow; otherwise wait a little.
                    wait = 0 if (polled and len(self._tasks) < self.max_in_flight) else 0.05
                    done, _ = await asyncio.wait(self._tasks, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        self._finish(task)
                finished = (exhausted or self._stopping) and not self._tasks
                if self._done and (finished or len(self._done) >= self.flush_size
                                   or time.perf_counter() - self._last_flush >= self.flush_interval_s):
                    await self._flush()
                if finished:
                    break
        finally:
            for task in self._tasks:
                task.cancel()
            self._db.shutdown(wait=True)
            self._io.shutdown(wait=True)
            source.close()
        self.stats.elapsed_s = time.perf_counter() - self.stats.started
        return self.stats

    async def _dispatch(self, messages: list[Message]) -> None:
        self.stats.messages += len(messages)
        value_format = self.pipeline.source.value_format
        decoded: list[tuple[Document, Message]] = []
        for message in messages:
            self.tracker.dispatch(message.position)
            try:
                decoded.append((self.pipeline.decoder.decode(message, value_format), message))
            except BadInput as exc:
                letter = DeadLetter(position=message.position, reason=exc.reason, detail=str(exc), payload=message.value)
                log.warning("dead_letter", reason=exc.reason, stream=message.position.stream,
                            partition=message.position.partition, offset=message.position.offset)
                self._done.append((DocumentOutcome(document=None, dead_letter=letter), _Pending(message.position, None, [])))
                self.tracker.complete(message.position)
        if not decoded:
            return
        keys = [key for doc, _ in decoded for key in self.executor.keys(doc)]
        lookup = await self._store(self.store.lookup, self.pipeline.name, [(d.tenant, d.key) for d, _ in decoded], keys)
        for doc, message in decoded:
            ref = (doc.tenant, doc.key)
            live = self._live.get(ref)
            if live is not None and live[0] == doc.content_hash:
                # The same document is already in flight or awaiting commit (a redelivery within
                # this run): wait for it, then complete this position with nothing to write.
                task = asyncio.create_task(self._after(live[1]))
                self._tasks[task] = _Pending(message.position, None, [])
                continue
            task = asyncio.create_task(self.executor.run(doc, message.value, lookup))
            self._tasks[task] = _Pending(message.position, ref, self.executor.keys(doc), task)
            self._live[ref] = (doc.content_hash, task)

    @staticmethod
    async def _after(task: asyncio.Task[Any]) -> tuple[DocumentOutcome, Tally]:
        await asyncio.wait([task])
        return DocumentOutcome(document=None), Tally()

    def _finish(self, task: asyncio.Task[tuple[DocumentOutcome, Tally]]) -> None:
        pending = self._tasks.pop(task)
        outcome, tally = task.result()  # executor turns every document failure into a dead letter
        self.stats.add(tally)
        self._done.append((outcome, pending))
        self.tracker.complete(pending.position)
        if self.on_progress is not None:
            self.on_progress(self.stats)

    async def _flush(self) -> None:
        done, self._done = self._done, []
        batch = Batch(outcomes=[outcome for outcome, _ in done], positions=self.tracker.take_watermarks())
        await self._store(self.store.write, self.pipeline.name, batch)
        await asyncio.get_running_loop().run_in_executor(self._io, self.pipeline.source.commit, batch.positions)
        self._last_flush = time.perf_counter()
        for outcome, pending in done:
            self.stats.results_written += len(outcome.results)
            self.stats.dead_letters += outcome.dead_letter is not None
            if pending.ref is not None and self._live.get(pending.ref, ("", None))[1] is pending.task:
                del self._live[pending.ref]
            self.executor.flights.forget(pending.keys)
        log.debug("flushed", pipeline=self.pipeline.name, outcomes=len(done), positions=len(batch.positions))
