"""The two batch wires, through the providers' official SDKs: OpenAI's Files and Batches, and
Anthropic's Message Batches. ``etl.llm.batch`` decides what to send and when; a wire only speaks.

Each wire turns a provider's result line into a :class:`Line`: an answer body (parsed by the
synchronous backend's ``answer``), a refusal (a 4xx: sending it again cannot help), or nothing yet
(errored, expired, cancelled: it may go into a later batch).

Finding a batch again after a crash between the create and recording the provider's id: OpenAI
keeps our id in the batch's ``metadata``. Anthropic's batches have no metadata, so a recorded batch
is matched to the provider's oldest batch created after it was recorded (less two minutes of clock
skew) with the same number of requests that no ledger row already holds; if another client of the
same workspace made such a batch in that minute, the match may be wrong, and then its answers are
not ours (unknown ids, ignored) and our requests go out again — a cost, never a wrong answer.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

import structlog

from connectors.store.batches import BatchRecord
from etl.llm.anthropic import AnthropicLLM
from etl.llm.openai_compat import OpenAICompatibleLLM

log = structlog.get_logger()
#: The metadata key that carries our batch id to OpenAI.
META = "idem_batch"
#: How much earlier than our record an Anthropic batch may say it was created (clocks differ).
SKEW = timedelta(minutes=2)


@dataclass(frozen=True)
class Line:
    """One request's result in a finished batch."""

    body: Any = None  # the answer, for the synchronous backend's ``answer``
    refused: str | None = None  # the provider refused the request itself (4xx): not sent again
    ended: bool = False  # the batch expired or was cancelled before answering it
    detail: str = "no result"


@dataclass(frozen=True)
class Finished:
    status: str  # completed | expired | cancelled | failed
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int | None = None


class Wire(Protocol):
    inner: Any
    max_lines: int
    max_bytes: int

    async def find(self, unconfirmed: list[BatchRecord], known: set[str]) -> dict[str, str]:
        """Provider ids of recorded batches whose create may have happened: ours -> theirs."""

    async def create(self, batch_id: str, items: list[tuple[str, dict[str, Any]]]) -> str:
        """Makes the batch (no retries: a retried create could make two); its provider id."""

    async def state(self, provider_id: str) -> Finished | None:
        """None while it runs."""

    async def results(self, batch: BatchRecord) -> tuple[dict[str, Line], int]:
        """Its result lines by ``custom_id`` and how many lines were repeated or unreadable."""

    async def cancel(self, provider_id: str) -> None: ...

    async def aclose(self) -> None: ...


def wire_for(inner: Any) -> Wire:
    if isinstance(inner, AnthropicLLM):
        return AnthropicWire(inner)
    return OpenAIWire(inner)


def _retryable(status: Any) -> bool:
    return not (isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429))


class OpenAIWire:
    """Files ``purpose=batch`` and ``/v1/batches`` (also vLLM's and other OpenAI-compatible servers')."""

    ENDPOINT = "/v1/chat/completions"
    max_lines = 50_000
    max_bytes = 190_000_000  # OpenAI takes input files up to 200 MB

    def __init__(self, inner: OpenAICompatibleLLM) -> None:
        from openai import AsyncOpenAI  # noqa: PLC0415

        self.inner = inner
        self.client = AsyncOpenAI(base_url=inner.base_url, api_key=inner.api_key.get_secret_value() or "none",
                                  max_retries=5)

    async def find(self, unconfirmed: list[BatchRecord], known: set[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        async for batch in self.client.batches.list(limit=100):
            ours = (batch.metadata or {}).get(META)
            if ours:
                found[ours] = batch.id
        return found

    async def create(self, batch_id: str, items: list[tuple[str, dict[str, Any]]]) -> str:
        data = "".join(json.dumps({"custom_id": c, "method": "POST", "url": self.ENDPOINT, "body": b}) + "\n"
                       for c, b in items).encode()
        upload = await self.client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
        created = await self.client.with_options(max_retries=0).batches.create(
            input_file_id=upload.id, endpoint=self.ENDPOINT, completion_window="24h", metadata={META: batch_id})
        return created.id

    async def state(self, provider_id: str) -> Finished | None:
        state = await self.client.batches.retrieve(provider_id)
        if state.status in ("validating", "in_progress", "finalizing", "cancelling"):
            return None
        return Finished(state.status if state.status in ("completed", "expired", "cancelled") else "failed",
                        state.output_file_id, state.error_file_id,
                        state.request_counts.completed if state.request_counts else None)

    async def results(self, batch: BatchRecord) -> tuple[dict[str, Line], int]:
        lines: dict[str, Line] = {}
        odd = 0
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:
                continue
            for record, custom_id in _records((await self.client.files.content(file_id)).text, batch):
                if record is None or custom_id in lines:
                    odd += 1
                    continue
                response = record.get("response") or {}
                status, body = response.get("status_code"), response.get("body")
                code = (record.get("error") or {}).get("code")
                lines[custom_id] = (
                    Line(body=body) if status == 200 else
                    Line(refused=f"({status}): {json.dumps(body)[:300]}") if not _retryable(status) else
                    Line(ended=code in ("batch_expired", "batch_cancelled"), detail=str(status or code or "no result")))
        return lines, odd

    async def cancel(self, provider_id: str) -> None:
        await self.client.batches.cancel(provider_id)

    async def aclose(self) -> None:
        await self.client.close()


class AnthropicWire:
    """Message Batches: ``/v1/messages/batches`` and its results JSONL."""

    max_lines = 100_000
    max_bytes = 240_000_000  # Anthropic takes batches up to 256 MB

    def __init__(self, inner: AnthropicLLM) -> None:
        from anthropic import AsyncAnthropic  # noqa: PLC0415

        self.inner = inner
        self.client = AsyncAnthropic(base_url=inner.base_url, api_key=inner.api_key.get_secret_value() or "none",
                                     max_retries=5)

    async def find(self, unconfirmed: list[BatchRecord], known: set[str]) -> dict[str, str]:
        if not unconfirmed:
            return {}
        floors = {b.id: _utc(b.created_at) - SKEW if b.created_at else datetime.min for b in unconfirmed}
        earliest = min(floors.values())
        candidates = []  # (created, provider id, requests) of batches no ledger row holds
        async for batch in self.client.messages.batches.list(limit=100):  # newest first
            created = _utc(batch.created_at)
            if created < earliest:
                break
            if batch.id not in known:
                counts = batch.request_counts
                candidates.append((created, batch.id, counts.processing + counts.succeeded + counts.errored
                                   + counts.canceled + counts.expired))
        found: dict[str, str] = {}
        for record in sorted(unconfirmed, key=lambda b: b.id):  # our ids are time-ordered
            match = next((c for c in sorted(candidates) if c[2] == record.lines and c[0] >= floors[record.id]), None)
            if match is not None:
                candidates.remove(match)
                found[record.id] = match[1]
                log.info("batch_matched", batch=record.id, provider_id=match[1], lines=record.lines)
        return found

    async def create(self, batch_id: str, items: list[tuple[str, dict[str, Any]]]) -> str:
        created = await self.client.with_options(max_retries=0).messages.batches.create(
            requests=[{"custom_id": c, "params": b} for c, b in items])  # type: ignore[misc]
        return created.id

    async def state(self, provider_id: str) -> Finished | None:
        state = await self.client.messages.batches.retrieve(provider_id)
        if state.processing_status != "ended":
            return None
        counts = state.request_counts
        status = "cancelled" if state.cancel_initiated_at else "expired" if counts.expired else "completed"
        return Finished(status, provider_id, None, counts.succeeded)  # results are read by the batch's id

    async def results(self, batch: BatchRecord) -> tuple[dict[str, Line], int]:
        lines: dict[str, Line] = {}
        odd = 0
        if not batch.output_file_id:
            return lines, odd
        state = await self.client.messages.batches.retrieve(batch.output_file_id)
        if not state.results_url:
            return lines, odd
        text = await self.client.get(state.results_url, cast_to=str)  # raw text: a bad line is one line
        for record, custom_id in _records(text, batch):
            if record is None or custom_id in lines:
                odd += 1
                continue
            result = record.get("result") or {}
            kind = result.get("type")
            error = ((result.get("error") or {}).get("error") or {})
            lines[custom_id] = (
                Line(body=result.get("message")) if kind == "succeeded" else
                Line(refused=f"({error.get('type')}): {error.get('message', '')[:300]}")
                if kind == "errored" and error.get("type") == "invalid_request_error" else
                Line(ended=kind in ("expired", "canceled"), detail=str(error.get("type") or kind or "no result")))
        return lines, odd

    async def cancel(self, provider_id: str) -> None:
        await self.client.messages.batches.cancel(provider_id)

    async def aclose(self) -> None:
        await self.client.close()


def _utc(moment: datetime) -> datetime:
    """As naive UTC (SQLite's clock is naive, PostgreSQL's and the SDKs' are aware)."""
    return moment.astimezone(timezone.utc).replace(tzinfo=None) if moment.tzinfo else moment


def _records(text: str, batch: BatchRecord) -> list[tuple[dict[str, Any] | None, str]]:
    """A JSONL result file's records with their ``custom_id`` (None for an unreadable line)."""
    out: list[tuple[dict[str, Any] | None, str]] = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
            custom_id = record["custom_id"]
            if not isinstance(custom_id, str):
                raise TypeError(custom_id)
        except (ValueError, KeyError, TypeError):
            log.warning("batch_line_unreadable", batch=batch.id, line=line[:200])
            out.append((None, ""))
            continue
        out.append((record, custom_id))
    return out
