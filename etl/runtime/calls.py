"""The model, for one stage of one document: claims across workers, retries, repairs, budgets.

Every attempt becomes a :class:`CallRecord` (costed by the backend's price), whatever the outcome:
paid work is never thrown away. A stage that cannot succeed raises :class:`StageFailed` carrying
those attempts and the typed reason of the last failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from connectors.store import CacheEntry
from connectors.store.sql import HELD, MINE
from etl.errors import (
    BudgetExceeded,
    EtlError,
    LLMError,
    OutputError,
    PeerFailed,
    SchemaInvalid,
    SemanticInvalid,
    StageError,
)
from etl.confidence import from_logprobs
from etl.llm.base import LLM, LLMRequest, LLMResponse
from etl.stages import StagePlan
from etl.tenancy import TenantBudgets
from schemas import CallRecord, Document

log = logging.getLogger(__name__)

_backoff = wait_random_exponential(multiplier=0.5, max=10)


def _wait_for_provider(state: RetryCallState) -> float:
    """The provider's Retry-After when it gave one, else exponential backoff with jitter."""
    error = state.outcome.exception() if state.outcome else None
    retry_after = getattr(error, "retry_after", None)
    return float(retry_after) if retry_after is not None else _backoff(state)


def plans_by_tenant(pipeline: Any, llm: LLM, repairs: int) -> dict[str, list[StagePlan]]:
    """The stage plans of each tenant configuration: ``""`` for every tenant without its own
    (overrides, model or a budget's fallback model), then each configured tenant's."""

    def plan(tenant: str, stage: Any) -> StagePlan:
        made = StagePlan.of(stage, pipeline.tenant_llms.get(tenant, llm), repairs)
        budget = pipeline.budgets.get(tenant)
        cheaper = None if budget is None else budget.fallback_for(stage.name)
        return made if cheaper is None else dataclasses.replace(made, fallback=StagePlan.of(stage, cheaper, repairs))

    fallbacks = {tenant for tenant, budget in pipeline.budgets.items() if budget.fallback is not None}
    return {"": [StagePlan.of(stage, llm, repairs) for stage in pipeline.stages],
            **{tenant: [plan(tenant, stage) for stage in pipeline.stages_for(tenant)]
               for tenant in sorted({*pipeline.tenant_stages, *pipeline.tenant_llms, *fallbacks})}}


@dataclass
class Computed:
    """A validated output: fresh, with every attempt it took, or made by another worker."""

    entry: CacheEntry
    calls: list[CallRecord]
    attempts: int
    latency_ms: float
    from_peer: bool = False
    #: A long document's answer (``etl.runtime.chunks``): its chunks' fresh cache entries, and its
    #: ``stage_chunks`` rows.
    chunk_entries: tuple[CacheEntry, ...] = ()
    chunks: tuple[dict[str, Any], ...] = ()


class Peers(Protocol):
    """Single-flight across workers on one store (see :class:`dedup.Claims`)."""

    #: Longest pause between two looks at a key another worker holds.
    max_wait_s: float

    async def claim(self, key: str) -> str:
        """``MINE`` if this worker may call the model for ``key`` now (its lease is renewed until
        ``release``), ``HELD`` if another worker is calling it, else the reason the holder's call
        failed."""

    def lost(self, key: str) -> bool:
        """Whether this worker's claim on ``key`` lapsed while it held it."""

    def release(self, keys: list[str]) -> None:
        """The keys' outcomes are committed: stop renewing their claims."""

    async def cached(self, key: str) -> CacheEntry | None:
        """The committed output for ``key``, if any worker has committed one."""


class StageFailed(EtlError):
    """A stage ended without a valid output; carries the attempts made, for cost accounting."""

    def __init__(self, error: EtlError, calls: list[CallRecord], cache: tuple[CacheEntry, ...] = ()) -> None:
        super().__init__(str(error))
        self.error = error
        self.calls = calls
        #: Valid answers paid on the way (the other chunks of a long document): kept, cached.
        self.cache = cache
        self.reason = error.reason


def record(document: Document, stage: str, key: str, model: str, outcome: Any, tokens_in: int,
           tokens_out: int, cost: float, latency_ms: float, error: str | None = None) -> CallRecord:
    """One row of ``llm_calls``."""
    return CallRecord(tenant=document.tenant, stage=stage, doc_key=document.key, cache_key=key, model=model,
                      outcome=outcome, tokens_in=tokens_in, tokens_out=tokens_out, cost=cost,
                      latency_ms=latency_ms, error=error)


class ModelCalls:
    """Asks a stage's model for a document, with the run's caps on retries and repairs."""

    def __init__(self, peers: Peers | None = None, max_attempts: int = 4, max_retry_s: float = 60.0,
                 repairs: int = 1, budgets: TenantBudgets | None = None) -> None:
        self.peers = peers
        self.max_attempts = max_attempts
        self.max_retry_s = max_retry_s
        self.repairs = repairs
        self.budgets = budgets

    async def asks_fallback(self, plan: StagePlan, tenant: str) -> bool:
        """Whether a fresh answer of ``plan`` for ``tenant`` comes from its budget's fallback model now."""
        return plan.fallback is not None and self.budgets is not None and await self.budgets.over_soft(tenant)

    async def ask(self, plan: StagePlan, document: Document, key: str, cheaper: bool = True) -> Computed:
        """``compute`` by the model the budget picks now: the plan's, or over the tenant's soft limit
        (when ``cheaper``) its fallback's, whose answer is under the fallback's own key."""
        if cheaper and await self.asks_fallback(plan, document.tenant):
            assert plan.fallback is not None  # noqa: S101
            return await self.compute(plan.fallback, document, plan.fallback.key(document))
        return await self.compute(plan, document, key)

    async def claim_or_wait(self, plan: StagePlan, document: Document, key: str, cheaper: bool = True) -> Computed:
        """Calls the model only while holding the key's claim; otherwise waits for the holder's
        committed result (or for its lease to lapse, if it crashed), or takes the holder's failure.
        A worker whose lease lapsed while the model worked, and was taken, keeps the attempts it
        paid for but not its answer: one answer per key is written.

        ``key`` is the plan's own, claimed whichever model answers: workers that disagree on a
        tenant's budget (each counts its own calls) still ask one model at a time for a content,
        and a waiter takes the answer under either model's key (``Computed.entry.cache_key``)."""
        if self.peers is None:
            return await self.ask(plan, document, key, cheaper)
        other = plan.fallback.key(document) if cheaper and plan.fallback is not None else None
        delay, paid = 0.05, []
        while True:
            # A claim is refused for a key that is already cached, so winning one means computing.
            state = await self.peers.claim(key)
            if state == MINE:
                if other is not None and (entry := await self.peers.cached(other)) is not None:
                    return Computed(entry=entry, calls=paid, attempts=0, latency_ms=0.0, from_peer=True)
                computed = await self.ask(plan, document, key, cheaper)
                if self.peers.lost(key):
                    state = await self.peers.claim(key)  # taken meanwhile, or still free?
                if state == MINE:
                    return dataclasses.replace(computed, calls=paid + computed.calls) if paid else computed
                paid += computed.calls
            if state != HELD:
                raise StageFailed(PeerFailed(state), paid)
            entry = await self.peers.cached(key)
            if entry is None and other is not None:
                entry = await self.peers.cached(other)
            if entry is not None:
                return Computed(entry=entry, calls=paid, attempts=0, latency_ms=0.0, from_peer=True)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.peers.max_wait_s)

    async def compute(self, plan: StagePlan, document: Document, key: str | None = None) -> Computed:
        """Asks the model, retrying transient failures and re-asking (``repairs`` times) after an
        invalid answer, and validates the final answer in layers. Every attempt becomes a call
        record. Raises StageFailed with the typed reason of the last failure. Bypasses the cache and
        claims (an eval calls it directly; ``key`` defaults to the document's)."""
        key = key or plan.key(document)
        stage = plan.stage
        request = LLMRequest(messages=stage.render(document), json_schema=stage.llm_schema(), max_tokens=stage.max_tokens,
                             key=key)
        calls: list[CallRecord] = []
        started = time.perf_counter()
        repairs_left = self.repairs
        kept: tuple[dict[str, Any], LLMResponse, int] | None = None  # a valid answer re-asked for grounding
        try:
            while True:
                if self.budgets is not None and not await self.budgets.allows(document.tenant):
                    raise BudgetExceeded(f"tenant {document.tenant!r} spent its daily token budget")
                response = await self._call(plan.llm, request, document, stage.name, key, calls)
                if self.budgets is not None:
                    self.budgets.spend(document.tenant, response.tokens_in + response.tokens_out)
                cost = plan.llm.cost(response.tokens_in, response.tokens_out)
                attempt = functools.partial(record, document, stage.name, key, response.model,
                                            tokens_in=response.tokens_in, tokens_out=response.tokens_out, cost=cost,
                                            latency_ms=response.latency_ms)
                try:
                    output = stage.parse(response)
                    data = output.model_dump(mode="json")
                    problem = stage.reask(output, document) if repairs_left > 0 else None
                except (SchemaInvalid, SemanticInvalid) as exc:
                    if repairs_left > 0:
                        repairs_left -= 1
                        calls.append(attempt("repair", error=exc.reason))
                        request = stage.repair(request, response.text, str(exc))
                        continue
                    calls.append(attempt("failed", error=exc.reason))
                    raise
                except OutputError as exc:
                    calls.append(attempt("failed", error=exc.reason))
                    raise
                except Exception:  # a validator's own bug: the answer was paid for all the same
                    calls.append(attempt("failed", error="stage_error"))
                    raise
                if problem is not None:
                    repairs_left -= 1  # valid, but not all of it is in the text: asked again, once per repair
                    kept = (data, response, len(calls))
                    calls.append(attempt("repair", error="ungrounded"))
                    request = stage.repair(request, response.text, problem)
                    continue
                calls.append(attempt("ok"))
                break
        except Exception as exc:
            if kept is None:
                error = exc if isinstance(exc, EtlError) else StageError(  # a validator or a backend's own
                    f"{type(exc).__name__}: {str(exc)[:300]}")
                raise StageFailed(error, calls) from exc
            # a re-ask for grounding that failed in any way keeps the valid answer it was to improve
            data, response, used = kept
            log.warning("%s/%s: the re-ask for ungrounded values failed (%s: %s); keeping the first answer",
                        document.tenant, document.key, type(exc).__name__, str(exc)[:200])
            calls[used] = calls[used].model_copy(update={"outcome": "ok"})
            # the attempts after it did not end the stage: one final outcome per stage run
            calls[used + 1:] = [c.model_copy(update={"outcome": "repair"}) if c.outcome == "failed" else c
                                for c in calls[used + 1:]]
        entry = CacheEntry(
            cache_key=key, tenant=document.tenant, stage=stage.name, fingerprint=plan.fingerprint,
            output=data, model=response.model, tokens_in=sum(c.tokens_in for c in calls),
            tokens_out=sum(c.tokens_out for c in calls), cost=sum(c.cost for c in calls),
            structured=response.extra.get("structured"), system_fingerprint=response.extra.get("system_fingerprint"),
            confidence=from_logprobs(response.text, response.token_logprobs, data) or None,
        )
        return Computed(entry=entry, calls=calls, attempts=len(calls),
                        latency_ms=(time.perf_counter() - started) * 1000)

    async def _call(self, llm: LLM, request: LLMRequest, document: Document, stage: str, key: str,
                    calls: list[CallRecord]) -> LLMResponse:
        """One answer from the model, retrying only what ``retryable`` says can succeed later,
        waiting as long as the provider's Retry-After asks, within the attempt and time caps."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, LLMError) and e.retryable),
            stop=stop_after_attempt(self.max_attempts) | stop_after_delay(self.max_retry_s),
            wait=_wait_for_provider,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    t0 = time.perf_counter()
                    try:
                        response = await llm.generate(request)
                    except LLMError as exc:
                        calls += _unanswered(document, stage, key, llm.model_id, exc.unanswered)
                        calls.append(record(document, stage, key, llm.model_id,
                                                  "retry" if exc.retryable else "failed", 0, 0, 0.0,
                                                  (time.perf_counter() - t0) * 1000, error=exc.reason))
                        raise
                    except Exception:  # a reply the backend could not read (a provider's malformed 200): sent, maybe billed
                        calls.append(record(document, stage, key, llm.model_id, "failed", 0, 0, 0.0,
                                            (time.perf_counter() - t0) * 1000, error="stage_error"))
                        raise
                    calls += _unanswered(document, stage, key, llm.model_id, response.unanswered)
                    return _within_columns(response, (time.perf_counter() - t0) * 1000)
        except LLMError:
            if calls and calls[-1].outcome == "retry":  # retries ran out: that attempt ended the stage
                calls[-1] = calls[-1].model_copy(update={"outcome": "failed"})
            raise
        raise AssertionError("unreachable")  # pragma: no cover


def _unanswered(document: Document, stage: str, key: str, model: str, sends: int) -> list[CallRecord]:
    """The sends a backend made again itself (a batch line errored or expired): each reached the
    provider, so each is an attempt, answered by nothing and billed nothing."""
    return [record(document, stage, key, model, "retry", 0, 0, 0.0, 0.0, error="unanswered") for _ in range(sends)]


def _within_columns(response: LLMResponse, latency_ms: float) -> LLMResponse:
    """The provider's own metadata cut to what the store's columns hold (a model name of 400
    characters must not quarantine a document), and the latency measured here if it gave none."""
    if (response.latency_ms and len(response.model) <= 300 and "\x00" not in response.model
            and not response.extra.keys() & {"structured", "system_fingerprint"}):
        return response  # the common case, per call: nothing to cut
    extra = dict(response.extra)
    for name, limit in (("structured", 20), ("system_fingerprint", 200)):
        if isinstance(extra.get(name), str):
            extra[name] = extra[name][:limit].replace("\x00", "")
    return dataclasses.replace(response, model=str(response.model)[:300].replace("\x00", ""), extra=extra,
                               latency_ms=response.latency_ms or latency_ms)
