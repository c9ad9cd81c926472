"""The batch tier: a backend's requests sent through its provider's batch API (OpenAI's Batch API
and OpenAI-compatible servers', or Anthropic's Message Batches: ``etl.llm.batch_wire``).

``generate`` does not call the model: it queues the request under its ``custom_id`` (the stage's
cache key; a repair has its own) and waits for the batch that answers it. Requests that arrive
together (a backfill dispatches its whole window at once) go out as one batch once no new one has
arrived for ``gather_s``; a document whose next stage applies asks again when its earlier stage is
answered, so multi-stage pipelines run in waves, and a repair goes into a follow-up batch. Answers
are joined by ``custom_id``, never by order; an unknown or repeated id is logged and ignored.

Nothing is sent twice across crashes: the ledger (``connectors.store.batches``) records each
batch and its ids before the provider creates it, under an id of ours (kept in the batch's metadata
where the provider has one). A restart finds live batches again (by that id, or by their time and
size, when the provider's id was never recorded), reads the results of finished ones, and sends
only what no batch holds.

The fingerprint is the wrapped backend's (``model_id``, ``params``): a batch answer is the same
model's answer and shares the cache with synchronous runs. Only the price differs: every attempt
is costed at the batch price (``discount`` × the synchronous one by default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from datetime import datetime, timezone
from typing import Any

import structlog

from connectors.store.batches import ANSWERED, BatchLedger, BatchRecord
from dedup import canonical_json, sha256_hex
from etl.errors import ContextOverflow, LLMError, TransientLLMError
from etl.llm.anthropic import AnthropicLLM
from etl.llm.base import LLM, LLMRequest, LLMResponse
from etl.llm.batch_wire import Line, wire_for
from etl.llm.openai_compat import OpenAICompatibleLLM

log = structlog.get_logger()


class BatchLineFailed(LLMError):
    """Batches returned an error (or nothing) for this request as often as it may be sent."""

    reason = "provider_error"


class BatchExpired(LLMError):
    """Batches ended (expired or cancelled) before answering this request, as often as it may be sent."""

    reason = "batch_expired"


class BatchLLM(LLM):
    """Sends ``inner``'s requests as provider batches.

    Args:
        inner: The synchronous backend: its request bodies, model and fingerprint are used as-is.
        ledger: Where batches are recorded (the pipeline's store).
        discount: Batch price ÷ synchronous price (OpenAI and Anthropic bill batches at 0.5).
        price_per_mtok: Explicit batch prices instead (USD per million input, output tokens).
        gather_s: A batch goes out once no request has arrived for this long.
        poll_s: How often live batches are checked.
        max_lines: Most requests per batch (at most the provider's: OpenAI 50,000, Anthropic 100,000).
        sends: How often one request may go out (an errored, expired or cancelled line goes into a
            later batch, however long the batches took); then it fails with its typed reason.
    """

    def __init__(self, inner: OpenAICompatibleLLM | AnthropicLLM, ledger: BatchLedger, *, discount: float = 0.5,
                 price_per_mtok: tuple[float, float] | None = None, gather_s: float = 0.5, poll_s: float = 5.0,
                 max_lines: int = 50_000, sends: int = 4) -> None:
        self.inner = inner
        self.ledger = ledger
        self.model_id = inner.model_id
        self.params = inner.params
        self.price_per_mtok = price_per_mtok or (inner.price_per_mtok[0] * discount, inner.price_per_mtok[1] * discount)
        self.wire = wire_for(inner)
        self.gather_s, self.poll_s, self.sends = gather_s, poll_s, sends
        self.max_lines = min(max_lines, self.wire.max_lines)
        self._bodies: dict[str, dict[str, Any]] = {}  # custom_id -> request body, while awaited
        self._sent: dict[str, int] = {}  # custom_id -> batches it went out in (this process)
        self._unanswered: dict[str, int] = {}  # custom_id -> sends that came back unanswered
        self._results: dict[str, dict[str, Line]] = {}  # our batch id -> its result lines by custom_id
        self._waiting: dict[str, list[asyncio.Future[LLMResponse]]] = {}
        self._queued: dict[str, dict[str, Any]] = {}  # custom_id -> request body, in no batch yet
        self._unchecked: set[str] = set()  # queued ids the ledger has not been asked about yet
        self._live: dict[str, BatchRecord] = {}  # our batch id -> the batch
        self._holds: dict[str, str] = {}  # custom_id -> our id of the live batch holding it
        self._last_request = 0.0
        self._failures = 0  # batches in a row the provider did not create
        self._loop: asyncio.Task[None] | None = None
        self._started = False
        self.stats = {"batches": 0, "lines": 0, "resumed": 0, "ignored": 0}

    async def generate(self, request: LLMRequest) -> LLMResponse:
        body = self.inner._body(request)
        custom_id = request.key or sha256_hex(canonical_json(body))
        future: asyncio.Future[LLMResponse] = asyncio.get_running_loop().create_future()
        first = custom_id not in self._waiting
        self._waiting.setdefault(custom_id, []).append(future)
        if first:
            self._queued[custom_id] = self._bodies[custom_id] = body
            self._unchecked.add(custom_id)
            self._last_request = time.monotonic()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())
        return await future

    # -- the loop: resume, submit, poll --------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while self._forget_cancelled():
            try:
                if not self._started:
                    await self._resume()
                    self._started = True
                await self._place()
                await self._poll()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the provider or the store failed this round
                failures += 1
                self._started = False  # a batch may be half recorded: resume reconciles it
                log.warning("batch_round_failed", failures=failures, error=f"{type(exc).__name__}: {exc}"[:300])
                if failures >= 10:  # ten rounds in a row: give up, every waiter learns it
                    self._fail_all(TransientLLMError(f"batch backend failed: {type(exc).__name__}: {exc}"))
                    return
            await asyncio.sleep(min(self.poll_s, self.gather_s) if self._queued else self.poll_s)

    def _forget_cancelled(self) -> bool:
        """Drops requests nobody waits for any more (their documents were cancelled); whether any
        request is still awaited."""
        for custom_id in [c for c, futures in self._waiting.items() if all(f.done() for f in futures)]:
            del self._waiting[custom_id]
            self._queued.pop(custom_id, None)
            self._bodies.pop(custom_id, None)
        return bool(self._waiting)

    def _fail_all(self, exc: Exception) -> None:
        for custom_id, futures in self._waiting.items():
            error = TransientLLMError(str(exc))
            error.unanswered = self._unanswered.pop(custom_id, 0)
            for future in futures:
                if not future.done():
                    future.set_exception(error)
        self._waiting.clear()
        self._queued.clear()
        self._bodies.clear()

    async def _resume(self) -> None:
        """Live batches of an earlier process: found again at the provider, or abandoned."""
        recorded = await asyncio.to_thread(self.ledger.live)
        found = await self._find([b for b in recorded if b.provider_id is None])
        for batch in recorded:
            provider_id = batch.provider_id or found.get(batch.id)
            if provider_id is None:  # recorded, then the process died before the provider made it
                await asyncio.to_thread(self.ledger.closed, batch.id, "abandoned")
                continue
            if batch.provider_id is None:
                await asyncio.to_thread(self.ledger.submitted, batch.id, provider_id)
            self._live[batch.id] = BatchRecord(batch.id, provider_id, "submitted", batch.lines)
            self.stats["resumed"] += 1

    async def _find(self, unconfirmed: list[BatchRecord]) -> dict[str, str]:
        """Which recorded batches the provider made after all: ours -> theirs."""
        if not unconfirmed:
            return {}
        return await self.wire.find(unconfirmed, await asyncio.to_thread(self.ledger.provider_ids))

    async def _place(self) -> None:
        """Queued requests already in a batch wait for it (or take its answer); the rest go out in
        new batches once the queue has been quiet for ``gather_s``."""
        if not self._queued:
            return
        unchecked = set(self._unchecked)
        holders = await asyncio.to_thread(self.ledger.batches_of, unchecked) if unchecked else {}
        self._unchecked -= unchecked
        answered: dict[str, tuple[BatchRecord, set[str]]] = {}
        for custom_id, batch in holders.items():
            if custom_id not in self._queued or self._sent.get(custom_id):
                continue  # this process sent it since: that batch answers it
            if batch.status in ANSWERED:  # finished before a crash: its answer was never committed
                answered.setdefault(batch.id, (batch, set()))[1].add(custom_id)
            elif batch.provider_id is not None:  # live: its answer is coming
                del self._queued[custom_id]
                self._holds[custom_id] = batch.id
                self._live.setdefault(batch.id, batch)
            # else recorded by another process that is creating it right now: not ours to wait on
        for batch, ids in answered.values():  # each finished batch's files read once
            for custom_id in ids - await self._settle_from(batch, ids, final=False):
                self._queued.pop(custom_id, None)  # answered; the others go out again
        ready = [c for c in self._queued if c not in self._unchecked]
        if ready and (time.monotonic() - self._last_request >= self.gather_s or len(ready) >= self.max_lines):
            items, size = [], 0
            for custom_id in ready[: self.max_lines]:  # and under the provider's input file limit
                size += len(json.dumps(self._queued[custom_id])) + 150
                if items and size > self.wire.max_bytes:
                    break
                items.append((custom_id, self._queued[custom_id]))
            for custom_id, _ in items:
                del self._queued[custom_id]
            await self._submit(items)

    async def _submit(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        try:
            await self._send(items)
        except BaseException:
            # Whatever failed (the store, the provider, a lookup), the requests stay queued and the
            # ledger is asked about them again first (after the next round's resume): a batch that
            # was made after all is waited on, not sent twice.
            for custom_id, body in items:
                if custom_id in self._waiting:
                    self._queued.setdefault(custom_id, body)
                    self._unchecked.add(custom_id)
            raise

    async def _send(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        batch_id = self.ledger.new_id()
        ids = [custom_id for custom_id, _ in items]
        recorded_at = datetime.now(timezone.utc)
        await asyncio.to_thread(self.ledger.record, batch_id, ids)  # before the provider hears of it
        try:
            # No retries of the create by the client: a retried create the provider had made would
            # be a second batch. A failed one is looked for instead.
            provider_id: str | None = await self.wire.create(batch_id, items)
        except Exception as exc:  # noqa: BLE001 - was it created anyway? Ask, then decide
            provider_id = (await self._find([BatchRecord(batch_id, None, "recorded", len(ids),
                                                         created_at=recorded_at)])).get(batch_id)
            if provider_id is None:
                await asyncio.to_thread(self.ledger.closed, batch_id, "abandoned")
                self._failures += 1
                log.warning("batch_not_created", batch=batch_id, error=f"{type(exc).__name__}: {exc}"[:300])
                if self._failures > 5:
                    raise
                self._queued.update(items)  # the next round sends them again
                return
        self._failures = 0
        await asyncio.to_thread(self.ledger.submitted, batch_id, provider_id)
        self._live[batch_id] = BatchRecord(batch_id, provider_id, "submitted", len(ids))
        for custom_id in ids:
            self._holds[custom_id] = batch_id
            self._sent[custom_id] = self._sent.get(custom_id, 0) + 1
        self.stats["batches"] += 1
        self.stats["lines"] += len(ids)
        log.info("batch_submitted", batch=batch_id, provider_id=provider_id, lines=len(ids))

    async def _poll(self) -> None:
        for batch_id, batch in list(self._live.items()):
            assert batch.provider_id is not None
            state = await self.wire.state(batch.provider_id)
            if state is None:
                continue
            status = state.status
            record = BatchRecord(batch_id, batch.provider_id, status, batch.lines, state.output_file_id,
                                 state.error_file_id)
            del self._live[batch_id]
            held = {c for c, b in self._holds.items() if b == batch_id}
            for custom_id in held:
                del self._holds[custom_id]
            await self._settle_from(record, held)
            self._results.pop(batch_id, None)
            await asyncio.to_thread(self.ledger.closed, batch_id, status, state.output_file_id, state.error_file_id)
            log.info("batch_finished", batch=batch_id, provider_id=batch.provider_id, status=status,
                     completed=state.completed)

    async def _settle_from(self, batch: BatchRecord, wanted: set[str], *, final: bool = True) -> set[str]:
        """Answers the waiters of ``wanted`` from a finished batch's files; the ones it did not
        answer fail too when ``final`` (else they are returned, to be sent again)."""
        answers = await self._lines(batch)
        unknown = [c for c in answers if c not in wanted and c not in self._bodies]
        if unknown:
            self.stats["ignored"] += len(unknown)
            log.warning("batch_lines_ignored", batch=batch.id, unknown=len(unknown), example=str(unknown[0])[:80])
        unanswered = set()
        for custom_id in wanted:
            line = answers.get(custom_id) or Line()
            if line.body is not None:
                try:
                    self._answer(custom_id, answer=self.inner.answer(line.body, 0.0))
                except LLMError as exc:
                    self._answer(custom_id, error=exc)
                continue
            if line.refused is not None:  # the request itself was refused: sending it again cannot help
                text = line.refused
                self._answer(custom_id, error=ContextOverflow(f"prompt too long: {text}")
                             if "context" in text.lower() or "too long" in text.lower()
                             else LLMError(f"provider refused the request {text}"))
                continue
            if not final or self._sent.get(custom_id, 0) < self.sends and custom_id in self._bodies:
                unanswered.add(custom_id)
                if final:  # into a later batch, however long this one took; that send was an attempt
                    self._queued[custom_id] = self._bodies[custom_id]
                    self._unanswered[custom_id] = self._unanswered.get(custom_id, 0) + 1
                continue
            if batch.status in ("expired", "cancelled") or line.ended:
                self._answer(custom_id, error=BatchExpired(f"batch {batch.id} ended ({batch.status}) before answering"))
            else:
                self._answer(custom_id, error=BatchLineFailed(f"batch {batch.id} ({batch.status}) returned {line.detail}"))
        return unanswered

    async def _lines(self, batch: BatchRecord) -> dict[str, Line]:
        """A finished batch's result lines by custom_id, read once (the first of a repeated id counts)."""
        if batch.id not in self._results:
            self._results[batch.id], odd = await self.wire.results(batch)
            if odd:
                self.stats["ignored"] += odd
                log.warning("batch_lines_repeated_or_unreadable", batch=batch.id, lines=odd)
        return self._results[batch.id]

    def _answer(self, custom_id: str, answer: LLMResponse | None = None, error: LLMError | None = None) -> None:
        self._bodies.pop(custom_id, None)
        self._queued.pop(custom_id, None)
        if unanswered := self._unanswered.pop(custom_id, 0):  # recorded by the caller as attempts
            if error is not None:
                error.unanswered = unanswered
            else:
                answer = dataclasses.replace(answer, unanswered=unanswered)  # type: ignore[arg-type]
        for future in self._waiting.pop(custom_id, []):
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(answer)  # type: ignore[arg-type]

    async def cancel_live(self) -> list[str]:
        """Asks the provider to cancel every live batch of this pipeline; returns their ids. Each is
        closed in the ledger when its cancellation is seen, by the next run (which sends again
        what it did not answer)."""
        cancelled = []
        for batch in await asyncio.to_thread(self.ledger.live):
            if batch.provider_id is None:
                continue
            await self.wire.cancel(batch.provider_id)
            cancelled.append(batch.provider_id)
        return cancelled

    async def aclose(self) -> None:
        if self._loop is not None and not self._loop.done():
            self._loop.cancel()
        await self.wire.aclose()
        await self.inner.aclose()
