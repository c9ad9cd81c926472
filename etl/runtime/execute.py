"""One document through every stage: stored result, cache, single-flight, or the model.

Pure of store I/O: it reads a :class:`Lookup` made before the batch and returns a
:class:`DocumentOutcome` for the runner to commit. The only I/O is the LLM call itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from connectors.store import CacheEntry, DocumentOutcome, Lookup
from dedup import SingleFlight, cache_keys
from etl.log import get_logger
from etl.runtime.calls import (
    Computed,
    ModelCalls,
    Peers,
    StageFailed,
    StagePlan,
    record,
)
from etl.grounding import Grounder
from etl.runtime.chunks import answer_in_chunks
from etl.runtime.chunks import attempts as count_attempts
from etl.runtime.decode import Decoded
from etl.storable import storable_text
from etl.stages import Extract, Stage
from etl.quality.router import Live, Students
from etl.tenancy import ReviewSampling
from schemas import CallRecord, DeadLetter, Document, Provenance, StageResult

__all__ = ["Computed", "Executor", "ModelCalls", "Peers", "StageFailed", "StagePlan", "Tally"]

log = get_logger("etl.runtime.execute")


@dataclass
class Tally:
    """What one document cost, for progress and the run summary."""

    stage_runs: int = 0
    stored_hits: int = 0
    cache_hits: int = 0
    llm_calls: int = 0
    saved_cost: float = 0.0
    #: Stage runs a router's student answered (no model call).
    student_answers: int = 0


class Executor:
    """Runs the stages of a pipeline for one document at a time (many concurrently)."""

    def __init__(self, plans_for: Callable[[str], Sequence[StagePlan]], calls: ModelCalls | None = None,
                 retry_dead_letters: bool = False, review: ReviewSampling | None = None,
                 students: Students | None = None) -> None:
        #: The stages a tenant runs, each with its model and hashes (tenant overrides included).
        self.plans_for = plans_for
        self.calls = calls or ModelCalls()
        self.review = review
        #: (tenant, stage, label) already sampled as a first sighting (loaded by the runner).
        self.seen_labels: set[tuple[str, str, str]] = set()
        self.flights: SingleFlight[Computed] = SingleFlight()
        #: What ``_about`` says of each plan list (lists held, so their ids stay theirs).
        self._about_plans: dict[int, tuple[Sequence[StagePlan], tuple[list[str], list[str], bool, bool]]] = {}
        #: ``etl dlq replay``: quarantined documents are retried instead of being no-ops.
        self.retry_dead_letters = retry_dead_letters
        #: The routed stages' active students (see ``etl.quality.router``), if any stage has a router.
        self.students = students

    def keys(self, document: Decoded | Document) -> list[str]:
        """The document's cache key for each of its tenant's stages, in plan order."""
        return cache_keys(document.tenant, self._about(document.tenant)[1], document.content_hash)

    def alternates(self, document: Decoded | Document) -> list[str]:
        """The document's cache keys under its tenant's fallback models (``Budget.fallback``), for
        the stages that have one: a stored or cached answer under them serves the stage too."""
        if not self._about(document.tenant)[3]:
            return []
        return [plan.fallback.key(document) for plan in self.plans_for(document.tenant) if plan.fallback is not None]

    def stage_names(self, tenant: str) -> list[str]:
        """The tenant's stage names, in plan order (as ``keys``)."""
        return self._about(tenant)[0]

    def _about(self, tenant: str) -> tuple[list[str], list[str], bool, bool]:
        """(stage names, fingerprints, whether any stage has a when= predicate, whether any has a
        fallback model) of a tenant's plans, which never change during a run."""
        plans = self.plans_for(tenant)
        about = self._about_plans.get(id(plans))
        if about is None or about[0] is not plans:  # by the list: tenants without overrides share one
            about = self._about_plans[id(plans)] = (plans, (
                [plan.stage.name for plan in plans], [plan.fingerprint for plan in plans],
                any(plan.stage.when is not None for plan in plans), any(plan.fallback is not None for plan in plans)))
        return about[1]

    def try_stored(self, document: Decoded | Document, lookup: Lookup, keys: Sequence[str]) -> int | None:
        """The redelivery fast path, without a task, an await or a Document: when exactly the stages
        that apply are stored (or already dead-lettered) for this exact key, the number of stage
        runs so served, with nothing to call or write; else None (``run`` takes it from there)."""
        tenant, doc_key = ref = (document.tenant, document.key)
        plans = self.plans_for(tenant)
        needs_outputs = self._about(tenant)[2]
        if not needs_outputs and ref not in lookup.dead:
            # Every stage applies and none can be quarantined: stored means every key is.
            for plan, key in zip(plans, keys, strict=True):
                stored = lookup.results.get((tenant, doc_key, plan.stage.name))
                if stored is None or (stored[0] != key and stored[0] != _fallback_key(plan, document)):
                    return None
            return len(plans)
        hits = 0
        outputs: dict[str, BaseModel] = {}
        for plan, key in zip(plans, keys, strict=True):
            stage = plan.stage
            stored = lookup.results.get((*ref, stage.name))
            try:
                if not stage.applies(outputs):
                    if stored is not None:
                        return None  # a result that no longer applies: run() removes it
                    continue
            except Exception:  # noqa: BLE001 - run() turns it into a dead letter
                return None
            either = _either(plan, key, document)
            dead = not self.retry_dead_letters and any(k in lookup.dead.get(ref, ()) for k in either)
            if (stored is None or stored[0] not in either) and not dead:
                return None
            hits += 1
            if dead:
                return hits
            if needs_outputs:
                output = _revalidated(stage, stored[1])  # type: ignore[index]
                if output is None:
                    return None
                outputs[stage.name] = output
        return None if ref in lookup.dead else hits

    async def run(self, document: Document, payload: bytes, lookup: Lookup,
                  keys: Sequence[str]) -> tuple[DocumentOutcome, Tally]:
        """All stages for one document; ``keys`` are its cache keys, one per plan (see ``keys``).
        Whatever goes wrong with this document or its answers ends as its dead letter."""
        tally = Tally()
        work = _Work()
        try:
            return await self._run(document, payload, lookup, keys, tally, work), tally
        except Exception as exc:  # noqa: BLE001 - one document can never stop a run (invariant 7)
            log.warning("stage_failed", reason="stage_error", tenant=document.tenant, doc_key=document.key,
                        error=type(exc).__name__)
            return self._dead(document, payload, work.stage, work.key, "stage_error",
                              f"{type(exc).__name__}: {str(exc)[:300]}", None, work,
                              self._settles(document, lookup)), tally

    def _settles(self, document: Document, lookup: Lookup) -> bool:
        return self.retry_dead_letters or (document.tenant, document.key) in lookup.dead

    async def _run(self, document: Document, payload: bytes, lookup: Lookup, keys: Sequence[str], tally: Tally,
                   work: _Work) -> DocumentOutcome:
        outputs: dict[str, BaseModel] = {}
        ref = (document.tenant, document.key)
        settles = self._settles(document, lookup)
        stored_stages = 0  # stages stored before whose results this version keeps
        plans = self.plans_for(document.tenant)
        for plan, key in zip(plans, keys, strict=True):
            stage = plan.stage
            work.stage, work.key = stage.name, key
            stored = lookup.results.get((*ref, stage.name))
            try:
                applies = stage.applies(outputs)
            except Exception as exc:  # user code in when=; its failure must not stop the run
                return self._dead(document, payload, stage.name, None, "stage_error",
                                  f"when= raised {type(exc).__name__}: {exc}", None, work, settles)
            if not applies:
                continue
            tally.stage_runs += 1
            # the keys an answer of this stage may be stored or cached under: the plan's, and its
            # fallback model's (a tenant over its soft budget), which serves a redelivery as well
            either = _either(plan, key, document)
            if stored is not None and stored[0] in either and (
                    stored[1] is None or (reused := _revalidated(stage, stored[1])) is not None):
                # Redelivery: this exact result is already committed. Nothing to call or write.
                tally.stored_hits += 1
                stored_stages += 1
                work.stages.append(stage.name)
                if stored[1] is not None:  # outputs are looked up whenever a when= predicate may read them
                    outputs[stage.name] = reused
                continue
            letter = next((k for k in either if k in lookup.dead.get(ref, ())), None)
            if letter is not None and not self.retry_dead_letters:
                tally.stored_hits += 1
                if letter in lookup.restated:
                    # This content failed at an older position of the document: the newer copy
                    # ends the same way, at its own position, without a call.
                    reason = lookup.dead_reasons.get(letter, "stage_error")
                    return self._dead(document, payload, stage.name, letter, reason,
                                      f"the same content already failed ({reason}) at an older position; "
                                      "`etl dlq replay` retries it", None, work, settles)
                # Already ended as a dead letter for this content and fingerprint: nothing more to
                # ask. What this run paid for before it (a changed earlier stage) is stored, and the
                # letter stays open.
                if not work.results and not self._stale(ref, plans, lookup, stored_stages):
                    return DocumentOutcome(document=None)
                return self._outcome(document, payload, work, settles, letter_stands=True)
            main, main_key = plan, key
            entry, refused = None, False
            for k, p in zip(either, (plan, plan.fallback), strict=False):  # the plan's own answer first
                found = lookup.cache.get(k) or (lookup.held.get(k) if k in lookup.restated else None)
                if found is not None and _revalidated(stage, found.output) is None:
                    refused = True
                elif found is not None:
                    entry = found
                    plan, key = p, k  # type: ignore[assignment] # an answer of the fallback is the fallback's result
                    break
            # A cached (or stored) answer the stage's checks now refuse is asked again (without claims:
            # a cached key cannot be claimed); re-validating never stops a run.
            fresh = entry is None and (refused or (stored is not None and stored[0] in either))
            shared = entry is not None
            computed: Computed | None = None
            leads = False  # whether this document made the model calls of its stage's flight
            shadow: tuple[Live, tuple[BaseModel, str]] | None = None
            # the tenant's own stage says whether it is routed (a router is not in the fingerprint)
            if entry is None and self.students is not None and (router := getattr(stage, "router", None)) and (
                    live := self.students.active(document.tenant, stage.name, plan.fingerprint)) is not None:
                answered = live.answer(stage, document.content)
                if answered is not None and not router.shadowed(key):
                    self._student_result(live, plan, key, answered[0], work, tally)
                    outputs[stage.name] = answered[0]
                    self._sample_review(document, stage.name, work.results[-1].output, work)
                    continue
                if answered is not None:
                    shadow = (live, answered)  # also asked of the LLM, whose answer is stored
            # Over the tenant's soft budget its cheaper model answers, under its own key; the flight
            # and the claim stay the plan's key whichever model answers, so one content is asked of
            # one model at a time. A shadow check still asks the main model (the student is
            # certified against it).
            cheaper = shadow is None and plan.fallback is not None
            in_chunks = False
            if entry is None:
                use = plan
                if cheaper and plan.chunk_tokens is not None and await self.calls.asks_fallback(plan, document.tenant):
                    use = plan.fallback  # type: ignore[assignment] # the fallback's chunks are its own
                parts = use.chunks(document.content)
                in_chunks = len(parts) > 1
                if in_chunks:  # a long document: its chunks are the cache units
                    compute = functools.partial(answer_in_chunks, self.flights, self.calls, use, document,
                                                use.key(document), stage.chunks_to_ask(parts))
                else:
                    compute = functools.partial(self.calls.ask if fresh else self.calls.claim_or_wait, plan,
                                                document, key, cheaper)
                # Only the flight's leader counts and records its attempts: a follower in this
                # worker shares the leader's answer or failure, not its spend.
                leads = key not in self.flights
                try:
                    computed, shared = await self.flights.do(key, compute)
                except StageFailed as failed:
                    log.warning("stage_failed", reason=failed.reason, tenant=document.tenant, stage=stage.name,
                                doc_key=document.key, stream=document.position.stream,
                                partition=document.position.partition, offset=document.position.offset)
                    if leads:
                        tally.llm_calls += count_attempts(failed.calls)
                        work.calls.extend(failed.calls)
                        work.cache.extend(failed.cache)
                    if shadow is not None:  # only a shadow check failed: the student's answer stands, unchecked
                        self._student_result(shadow[0], plan, key, shadow[1][0], work, tally)
                        outputs[stage.name] = shadow[1][0]
                        self._sample_review(document, stage.name, work.results[-1].output, work)
                        continue
                    raw = getattr(failed.error, "raw", None)
                    return self._dead(document, payload, stage.name, key, failed.reason, str(failed.error), raw,
                                      work, settles)
                entry = computed.entry
                shared = shared or computed.from_peer
                if entry.cache_key != main_key:  # the fallback's answer: its plan, its key
                    plan, key = main.fallback, entry.cache_key  # type: ignore[assignment]
                    if not in_chunks:
                        work.claimed.append(main_key)  # claimed, answered under the fallback's key
            output = stage.output_model.model_validate(entry.output)
            outputs[stage.name] = output
            if shared and key in lookup.restated:
                tally.stored_hits += 1  # what this document held already, at an older position
                attempts, latency = 0, 0.0
            elif shared:
                if computed is not None and computed.calls and leads:  # attempts paid before a lost lease
                    tally.llm_calls += count_attempts(computed.calls)
                    work.calls.extend(computed.calls)
                tally.cache_hits += 1
                tally.saved_cost += entry.cost
                work.calls.append(record(document, stage.name, key, entry.model, "cache_hit",
                                         entry.tokens_in, entry.tokens_out, entry.cost, 0.0))
                attempts, latency = 0, 0.0
            else:
                assert computed is not None  # noqa: S101 - only a fresh computation is unshared
                tally.llm_calls += count_attempts(computed.calls)
                tally.saved_cost += sum(c.cost for c in computed.calls if c.outcome == "cache_hit")  # chunks
                work.calls.extend(computed.calls)
                work.cache.append(entry)
                work.cache.extend(computed.chunk_entries)
                attempts, latency = computed.attempts, computed.latency_ms
                if getattr(stage, "router", None) is not None and plan is main:
                    work.texts.append((key, document.content))  # the next student's training set
                if shadow is not None and self.students is not None:
                    live, (_, mine) = shadow
                    work.checks.append((live.id, stage.name, key, mine, entry.output["label"]))
                    self.students.observe(live, mine == entry.output["label"])
            if computed is not None:
                work.chunks.extend(computed.chunks)
            if isinstance(stage, Extract) and stage.grounding != "off":
                spans = Grounder(document.content).spans(entry.output)
                sure = entry.confidence or {}
                work.spans.extend({"stage": stage.name, "path": s.path, "value": s.value, "char_start": s.start,
                                   "char_end": s.end, "page": s.page, "match": s.match, "score": s.score,
                                   "confidence": sure.get(s.path, (None, None))[0],
                                   "confidence_from": sure.get(s.path, (None, None))[1]}
                                  for s in spans)
                if stage.grounding == "quarantine" and (lost := next((s for s in spans if not s.grounded), None)):
                    return self._dead(document, payload, stage.name, key, "ungrounded",
                                      f"{lost.path} = {lost.value[:100]!r} is not in the document's text", None, work,
                                      settles)
            work.stages.append(stage.name)
            work.results.append(StageResult(
                stage=stage.name,
                output=entry.output,
                provenance=Provenance(
                    fingerprint=plan.fingerprint, cache_key=key, model=entry.model,
                    prompt_hash=plan.prompt_hash, schema_hash=plan.schema_hash, cache_hit=shared,
                    attempts=attempts, tokens_in=0 if shared else entry.tokens_in,
                    tokens_out=0 if shared else entry.tokens_out, cost=0.0 if shared else entry.cost,
                    latency_ms=latency, structured=entry.structured, system_fingerprint=entry.system_fingerprint,
                ),
            ))
            if isinstance(stage, Extract):
                work.typed.append((stage.table, {**output.model_dump(), "cache_key": key}))
            self._sample_review(document, stage.name, entry.output, work)
        if not work.results and not settles and not self._stale(ref, plans, lookup, stored_stages):
            return DocumentOutcome(document=None)
        return self._outcome(document, payload, work, settles)

    @staticmethod
    def _stale(ref: tuple[str, str], plans: Sequence[StagePlan], lookup: Lookup, kept: int) -> bool:
        """Whether the document has stored results of stages this version no longer has (a when=
        that now says no): then the outcome is written, and they go."""
        return sum((*ref, plan.stage.name) in lookup.results for plan in plans) > kept

    @staticmethod
    def _outcome(document: Document, payload: bytes, work: _Work, settles: bool, dead_letter: DeadLetter | None = None,
                 letter_stands: bool = False) -> DocumentOutcome:
        """What the document's version has: every result so far (paid work is kept), and the dead
        letter it ends as, if any."""
        return DocumentOutcome(document=document, results=tuple(work.results), stages=tuple(work.stages),
                               typed_rows=tuple(work.typed), calls=tuple(work.calls), cache=tuple(work.cache),
                               dead_letter=dead_letter, letter_stands=letter_stands, settles_dead_letters=settles,
                               reviews=tuple(work.reviews), payload=payload, texts=tuple(work.texts),
                               checks=tuple(work.checks), chunks=tuple(work.chunks), spans=tuple(work.spans),
                               claimed=tuple(work.claimed))

    def _sample_review(self, document: Document, stage: str, output: dict[str, Any], work: _Work) -> None:
        if self.review is not None and (why := self.review.reason(
                document.tenant, stage, document.key, output, self.seen_labels)):
            work.reviews.append((stage, output, why, document.content if self.review.store_text else ""))

    @staticmethod
    def _student_result(live: Live, plan: StagePlan, key: str, output: BaseModel, work: _Work, tally: Tally) -> None:
        """The student's answer as the stage's result: provenance says who answered; it costs
        nothing and saves what the model's answers cost on average. Not a cache entry."""
        tally.student_answers += 1
        tally.saved_cost += live.mean_cost
        work.stages.append(plan.stage.name)
        work.results.append(StageResult(stage=plan.stage.name, output=output.model_dump(mode="json"), provenance=Provenance(
            fingerprint=plan.fingerprint, cache_key=key, model=live.answered_by, prompt_hash=plan.prompt_hash,
            schema_hash=plan.schema_hash, cache_hit=False, attempts=0, tokens_in=0, tokens_out=0, cost=0.0,
            latency_ms=0.0, answered_by=live.answered_by)))

    @classmethod
    def _dead(cls, document: Document, payload: bytes, stage: str | None, key: str | None, reason: str, detail: str,
              raw: str | None, work: _Work, settles: bool) -> DocumentOutcome:
        """The document's dead letter, with the stages before the failing one (paid work is kept)."""
        letter = DeadLetter(position=document.position, reason=reason, detail=storable_text(detail), payload=payload,
                            tenant=document.tenant, doc_key=document.key, stage=stage, cache_key=key,
                            raw_output=None if raw is None else storable_text(raw))
        return cls._outcome(document, payload, work, settles, letter)


def _fallback_key(plan: StagePlan, document: Decoded | Document) -> str | None:
    return None if plan.fallback is None else plan.fallback.key(document)


def _either(plan: StagePlan, key: str, document: Decoded | Document) -> tuple[str, ...]:
    """The keys a stored or cached answer of ``plan`` may be under: its own, then its fallback's."""
    return (key,) if plan.fallback is None else (key, plan.fallback.key(document))


def _revalidated(stage: Stage, output: dict[str, Any]) -> BaseModel | None:
    """A stored or cached output as the stage's model today, or None if the model's own checks now
    refuse it (a tightened validator): then it is computed again, never a crash."""
    try:
        return stage.output_model.model_validate(output)
    except ValueError:  # pydantic's ValidationError, or a validator's ValueError
        return None


@dataclass
class _Work:
    """What a document's stages produced so far (kept when a later stage fails: paid work)."""

    stage: str | None = None
    key: str | None = None
    stages: list[str] = dataclasses.field(default_factory=list)
    results: list[StageResult] = dataclasses.field(default_factory=list)
    typed: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    calls: list[CallRecord] = dataclasses.field(default_factory=list)
    cache: list[CacheEntry] = dataclasses.field(default_factory=list)
    reviews: list[tuple[str, dict[str, Any], str, str]] = dataclasses.field(default_factory=list)
    texts: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    checks: list[tuple[int, str, str, str, str]] = dataclasses.field(default_factory=list)
    chunks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    spans: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    claimed: list[str] = dataclasses.field(default_factory=list)
