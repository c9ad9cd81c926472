"""The batch tier: an OpenAI-compatible backend's requests sent through the provider's Batch API.

``generate`` does not call the model: it queues the request under its ``custom_id`` (the stage's
cache key; a repair has its own) and waits for the batch that answers it. Requests that arrive
together (a backfill dispatches its whole window at once) go out as one batch once no new one has
arrived for ``gather_s``; a document whose next stage applies asks again when its earlier stage is
answered, so multi-stage pipelines run in waves, and a repair goes into a follow-up batch. Answers
are joined by ``custom_id``, never by order; an unknown or repeated id is logged and ignored.

Nothing is sent twice across crashes: the ledger (``connectors.store.batches``) records each
batch and its ids before the provider creates it, under an id of ours kept in the batch's
metadata. A restart finds live batches again (by that metadata when the provider's id was never
recorded), reads the output files of finished ones, and sends only what no batch holds.

The fingerprint is the wrapped backend's (``model_id``, ``params``): a batch answer is the same
model's answer and shares the cache with synchronous runs. Only the price differs: every attempt
is costed at the batch price (``discount`` × the synchronous one by default).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import structlog
from openai import AsyncOpenAI

from connectors.store.batches import ANSWERED, BatchLedger, BatchRecord
from dedup import canonical_json, sha256_hex
from etl.errors import LLMError, TransientLLMError
from etl.llm.base import LLM, LLMRequest, LLMResponse
from etl.llm.openai_compat import OpenAICompatibleLLM

log = structlog.get_logger()
ENDPOINT = "/v1/chat/completions"
#: The metadata key that carries our batch id to the provider.
META = "idem_batch"


class BatchLineFailed(TransientLLMError):
    """A batch returned an error (or nothing) for this request: retried in a later batch."""

    reason = "provider_error"


class BatchExpired(TransientLLMError):
    """The batch ended (expired or cancelled) before answering this request."""

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
        max_lines: Most requests per batch (OpenAI: 50,000).
    """

    def __init__(self, inner: OpenAICompatibleLLM, ledger: BatchLedger, *, discount: float = 0.5,
                 price_per_mtok: tuple[float, float] | None = None, gather_s: float = 0.5, poll_s: float = 5.0,
                 max_lines: int = 50_000) -> None:
        self.inner = inner
        self.ledger = ledger
        self.model_id = inner.model_id
        self.params = inner.params
        self.price_per_mtok = price_per_mtok or (inner.price_per_mtok[0] * discount, inner.price_per_mtok[1] * discount)
        self.gather_s, self.poll_s, self.max_lines = gather_s, poll_s, max_lines
        self.client = AsyncOpenAI(base_url=inner.base_url, api_key=inner.api_key.get_secret_value() or "none",
                                  max_retries=5)
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
            self._queued[custom_id] = body
            self._unchecked.add(custom_id)
            self._last_request = time.monotonic()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())
        return await future

    # -- the loop: resume, submit, poll --------------------------------------------------------

    async def _run(self) -> None:
        try:
            if not self._started:
                await self._resume()
                self._started = True
            while self._waiting:
                await self._place()
                await self._poll()
                await asyncio.sleep(min(self.poll_s, self.gather_s) if self._queued else self.poll_s)
        except Exception as exc:  # noqa: BLE001 - every waiter learns it, nobody hangs
            for futures in self._waiting.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc if isinstance(exc, LLMError) else TransientLLMError(
                            f"batch backend failed: {type(exc).__name__}: {exc}"))
            self._waiting.clear()
            self._queued.clear()

    async def _resume(self) -> None:
        """Live batches of an earlier process: found again at the provider, or abandoned."""
        recorded = await asyncio.to_thread(self.ledger.live)
        found = (await self._created()) if any(b.provider_id is None for b in recorded) else {}
        for batch in recorded:
            provider_id = batch.provider_id or found.get(batch.id)
            if provider_id is None:  # recorded, then the process died before the provider made it
                await asyncio.to_thread(self.ledger.closed, batch.id, "abandoned")
                continue
            if batch.provider_id is None:
                await asyncio.to_thread(self.ledger.submitted, batch.id, provider_id)
            self._live[batch.id] = BatchRecord(batch.id, provider_id, "submitted", batch.lines)
            self.stats["resumed"] += 1

    async def _created(self) -> dict[str, str]:
        """The provider's batches that carry an id of ours: ours -> theirs."""
        found: dict[str, str] = {}
        async for batch in self.client.batches.list(limit=100):
            ours = (batch.metadata or {}).get(META)
            if ours:
                found[ours] = batch.id
        return found

    async def _place(self) -> None:
        """Queued requests already in a batch wait for it (or take its answer); the rest go out in
        new batches once the queue has been quiet for ``gather_s``."""
        if not self._queued:
            return
        unchecked, self._unchecked = self._unchecked, set()
        holders = await asyncio.to_thread(self.ledger.batches_of, unchecked) if unchecked else {}
        for custom_id, batch in holders.items():
            if custom_id not in self._queued:
                continue
            if batch.status in ANSWERED:  # finished (before a crash, or an errored line): its answer?
                if not await self._settle_from(batch, {custom_id}, final=False):
                    del self._queued[custom_id]  # answered; else it goes out again
            elif batch.provider_id is not None:  # live: its answer is coming
                del self._queued[custom_id]
                self._holds[custom_id] = batch.id
                self._live.setdefault(batch.id, batch)
            # else recorded by another process that is creating it right now: not ours to wait on
        if self._queued and (time.monotonic() - self._last_request >= self.gather_s
                             or len(self._queued) >= self.max_lines):
            items = list(self._queued.items())[: self.max_lines]
            for custom_id, _ in items:
                del self._queued[custom_id]
            await self._submit(items)

    async def _submit(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        batch_id = self.ledger.new_id()
        ids = [custom_id for custom_id, _ in items]
        await asyncio.to_thread(self.ledger.record, batch_id, ids)  # before the provider hears of it
        data = "".join(json.dumps({"custom_id": c, "method": "POST", "url": ENDPOINT, "body": b}) + "\n"
                       for c, b in items).encode()
        try:
            upload = await self.client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
            created = await self.client.batches.create(input_file_id=upload.id, endpoint=ENDPOINT,
                                                       completion_window="24h", metadata={META: batch_id})
            provider_id: str | None = created.id
        except Exception as exc:  # noqa: BLE001 - was it created anyway? Ask, then decide
            provider_id = (await self._created()).get(batch_id)
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
        self.stats["batches"] += 1
        self.stats["lines"] += len(ids)
        log.info("batch_submitted", batch=batch_id, provider_id=provider_id, lines=len(ids))

    async def _poll(self) -> None:
        for batch_id, batch in list(self._live.items()):
            assert batch.provider_id is not None
            state = await self.client.batches.retrieve(batch.provider_id)
            if state.status in ("validating", "in_progress", "finalizing", "cancelling"):
                continue
            status = state.status if state.status in (*ANSWERED, "failed") else "failed"
            record = BatchRecord(batch_id, batch.provider_id, status, batch.lines, state.output_file_id,
                                 state.error_file_id)
            del self._live[batch_id]
            held = {c for c, b in self._holds.items() if b == batch_id}
            for custom_id in held:
                del self._holds[custom_id]
            await self._settle_from(record, held)
            await asyncio.to_thread(self.ledger.closed, batch_id, status, state.output_file_id, state.error_file_id)
            log.info("batch_finished", batch=batch_id, provider_id=batch.provider_id, status=status,
                     completed=state.request_counts.completed if state.request_counts else None)

    async def _settle_from(self, batch: BatchRecord, wanted: set[str], *, final: bool = True) -> set[str]:
        """Answers the waiters of ``wanted`` from a finished batch's files; the ones it did not
        answer fail too when ``final`` (else they are returned, to be sent again)."""
        answers: dict[str, dict[str, Any]] = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            content = await self.client.files.content(file_id)
            for line in content.text.splitlines():
                try:
                    record = json.loads(line)
                    custom_id = record["custom_id"]
                except (ValueError, KeyError, TypeError):
                    log.warning("batch_line_unreadable", batch=batch.id, line=line[:200])
                    continue
                if custom_id in answers or custom_id not in wanted:
                    self.stats["ignored"] += 1
                    log.warning("batch_line_ignored", batch=batch.id, custom_id=str(custom_id)[:80],
                                why="repeated" if custom_id in answers else "not asked")
                    continue
                answers[custom_id] = record
        unanswered = set()
        for custom_id in wanted:
            record = answers.get(custom_id)
            response = (record or {}).get("response") or {}
            if response.get("status_code") == 200:
                try:
                    self._answer(custom_id, answer=self.inner.answer(response.get("body"), 0.0))
                except LLMError as exc:
                    self._answer(custom_id, error=exc)
                continue
            if not final:
                unanswered.add(custom_id)
                continue
            error = (record or {}).get("error") or {}
            if batch.status in ("expired", "cancelled") or error.get("code") in ("batch_expired", "batch_cancelled"):
                self._answer(custom_id, error=BatchExpired(f"batch {batch.id} ended ({batch.status}) before answering"))
            else:
                status = response.get("status_code")
                self._answer(custom_id, error=BatchLineFailed(
                    f"batch {batch.id} ({batch.status}) returned {status or error.get('code') or 'no result'}"))
        return unanswered

    def _answer(self, custom_id: str, answer: LLMResponse | None = None, error: Exception | None = None) -> None:
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
            await self.client.batches.cancel(batch.provider_id)
            cancelled.append(batch.provider_id)
        return cancelled

    async def aclose(self) -> None:
        if self._loop is not None and not self._loop.done():
            self._loop.cancel()
        await self.client.close()
        await self.inner.aclose()
