"""One stage of one long document, answered chunk by chunk: each chunk is a cache unit of its own
(claimed, called, validated and cached like any document), and the chunks' answers are merged
into the document's answer.

A chunk's key is its own text's (``StagePlan.chunk_key``), never its position: an unchanged chunk
of an edited document is a cache hit wherever it moved. The merged answer is validated by the
stage's model like any answer and cached under the document's key, so a redelivery or a copy of
the same document is served without merging again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from connectors.store import CacheEntry
from dedup import SingleFlight
from etl.errors import SchemaInvalid, SemanticInvalid, StageError
from etl.formats import page_of
from etl.runtime.calls import Computed, ModelCalls, StageFailed, record
from etl.stages import StagePlan
from etl.stages.chunking import Chunk
from etl.stages.merge import merge_with_origins, merged_confidence
from etl.storable import value_problem
from schemas import CallRecord, Document


def attempts(calls: list[CallRecord] | tuple[CallRecord, ...]) -> int:
    """Model attempts among call records (a cache hit's record is none)."""
    return sum(call.outcome != "cache_hit" for call in calls)


async def answer_in_chunks(flights: SingleFlight[Computed], calls: ModelCalls, plan: StagePlan, document: Document,
                           key: str, parts: list[Chunk]) -> Computed:
    """The merged answer of ``parts`` under ``key``, with every attempt paid for any chunk, a
    ``cache_hit`` record for each chunk the cache answered, the chunks' fresh cache entries and the
    ``stage_chunks`` rows. Raises StageFailed (with the attempts of every chunk) if a chunk has no
    valid answer; the chunks that do keep theirs (cached: a retry pays only for the one that failed)."""
    chunk_plan = dataclasses.replace(plan, fingerprint=plan.chunk_fingerprint)
    stage = plan.stage.name

    async def one(part: Chunk) -> tuple[Computed | StageFailed, bool, bool]:
        chunk_key = plan.chunk_key(document.tenant, part.text)
        leads = chunk_key not in flights  # a chunk twice in one document, or in two at once: one call
        piece = document.model_copy(update={"content": part.text})
        try:
            computed, shared = await flights.do(chunk_key, lambda: calls.claim_or_wait(chunk_plan, piece, chunk_key))
        except StageFailed as failed:
            return failed, False, leads
        return computed, shared or computed.from_peer, leads

    outcomes = await asyncio.gather(*(one(part) for part in parts))
    paid: list[CallRecord] = []
    fresh: list[CacheEntry] = []
    rows: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []
    failure: StageFailed | None = None
    for part, (computed, shared, leads) in zip(parts, outcomes, strict=True):
        if isinstance(computed, StageFailed):
            failure = failure or computed
            if leads:
                paid += computed.calls
            continue
        if leads:  # the attempts of a flight are the leader's to record
            paid += computed.calls
        entry = computed.entry
        if shared:
            paid.append(record(document, stage, entry.cache_key, entry.model, "cache_hit", entry.tokens_in,
                               entry.tokens_out, entry.cost, 0.0))
        elif leads:
            fresh.append(entry)
        answers.append(entry.output)
        rows.append({"stage": stage, "ordinal": part.ordinal, "cache_key": entry.cache_key, "char_start": part.start,
                     "char_end": part.end, "page_start": page_of(document.content, part.start),
                     "page_end": page_of(document.content, max(part.start, part.end - 1)), "cache_hit": shared})
    if failure is not None:
        raise StageFailed(failure.error, paid, tuple(fresh)) from failure
    entries = [computed.entry for computed, _, _ in outcomes if isinstance(computed, Computed)]
    merged, origins = merge_with_origins(answers, plan.stage.rules)
    confidence = merged_confidence(answers, [e.confidence for e in entries], merged, origins, plan.stage.rules)
    try:
        validated = plan.stage.output_model.model_validate(plan.stage.merged(merged, confidence))
        output = validated.model_dump(mode="json")
        problem = value_problem(validated.model_dump())
    except (ValueError, RecursionError) as exc:  # the chunks' answers are valid, their merge is not
        raise StageFailed(SchemaInvalid(f"the merged answer of {len(parts)} chunks: {str(exc)[:300]}"), paid,
                          tuple(fresh)) from exc
    if problem is not None:
        raise StageFailed(SchemaInvalid(f"the merged answer of {len(parts)} chunks: {problem}"), paid, tuple(fresh))
    # the stage's validators judge the document's answer too, not only each chunk's (invariant 4)
    for validator in plan.stage.validators:
        try:
            problem = validator(validated)
        except Exception as exc:  # a validator's own bug: the chunks stay paid for and cached
            raise StageFailed(StageError(f"{type(exc).__name__}: {str(exc)[:300]}"), paid, tuple(fresh)) from exc
        if problem is not None:
            raise StageFailed(SemanticInvalid(f"the merged answer of {len(parts)} chunks: {problem}"), paid,
                              tuple(fresh))
    entry = CacheEntry(cache_key=key, tenant=document.tenant, stage=stage, fingerprint=plan.fingerprint, output=output,
                       model=entries[0].model, tokens_in=sum(e.tokens_in for e in entries),
                       tokens_out=sum(e.tokens_out for e in entries), cost=sum(e.cost for e in entries),
                       confidence=confidence or None)
    return Computed(entry=entry, calls=paid, attempts=attempts(paid), latency_ms=0.0, chunk_entries=tuple(fresh),
                    chunks=tuple(rows))
