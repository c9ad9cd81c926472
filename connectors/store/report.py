"""Read-only summaries of the store, for ``etl status``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, case, func, inspect, select

from connectors.store.sql import db_now
from connectors.store.tables import (
    dead_letters,
    documents,
    field_spans,
    llm_calls,
    llm_claims,
    source_positions,
    stage_chunks,
    stage_results,
)

NAMES = ("documents", "stages", "chunks", "grounding", "calls", "dead_letters", "positions", "in_flight")


def status(engine: Engine, pipeline: str | None = None,
           end_offsets: dict[tuple[str, int], int] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per pipeline: documents and results per stage, long documents' chunks, grounded values,
    calls and spend, dead letters, live claims, positions (with lag when the source's end offsets
    are given). Empty when never migrated."""
    if not inspect(engine).has_table("stage_results"):
        return {name: [] for name in NAMES}
    chunk, span = stage_chunks.c, field_spans.c

    def where(table: Any) -> Any:
        return table.c.pipeline == pipeline if pipeline else True

    queries = {
        "documents": select(documents.c.pipeline, documents.c.tenant, func.count().label("documents"))
        .where(where(documents)).group_by(documents.c.pipeline, documents.c.tenant)
        .order_by(documents.c.pipeline, documents.c.tenant),
        "stages": select(
            stage_results.c.pipeline, stage_results.c.stage, func.count().label("results"),
            func.sum(case((stage_results.c.cache_hit, 1), else_=0)).label("from_cache"),
        ).where(where(stage_results)).group_by(stage_results.c.pipeline, stage_results.c.stage)
        .order_by(stage_results.c.pipeline, stage_results.c.stage),
        "chunks": select(
            chunk.pipeline, chunk.tenant, chunk.stage, func.count(func.distinct(chunk.doc_key)).label("documents"),
            func.count().label("chunks"), func.sum(case((chunk.cache_hit, 1), else_=0)).label("chunks_from_cache"),
            func.max(chunk.page_end).label("most_pages"),
        ).where(where(stage_chunks)).group_by(chunk.pipeline, chunk.tenant, chunk.stage)
        .order_by(chunk.pipeline, chunk.tenant, chunk.stage),
        "grounding": select(
            span.pipeline, span.tenant, span.stage, func.count().label("values"),
            func.sum(case((span.match != "none", 1), else_=0)).label("grounded"),
            func.sum(case((span.match == "none", 1), else_=0)).label("ungrounded"),
            func.count(span.confidence).label("with_confidence"),
            func.avg(span.confidence).label("mean_confidence"),
        ).where(where(field_spans)).group_by(span.pipeline, span.tenant, span.stage)
        .order_by(span.pipeline, span.tenant, span.stage),
        "calls": select(
            llm_calls.c.pipeline, llm_calls.c.tenant, llm_calls.c.stage, llm_calls.c.model,
            func.sum(case((llm_calls.c.outcome != "cache_hit", 1), else_=0)).label("attempts"),
            func.sum(case((llm_calls.c.outcome.in_(("retry", "repair", "failed")), 1), else_=0)).label("not_ok"),
            func.sum(case((llm_calls.c.outcome == "cache_hit", 1), else_=0)).label("cache_hits"),
            func.sum(case((llm_calls.c.outcome != "cache_hit", llm_calls.c.tokens_in + llm_calls.c.tokens_out),
                          else_=0)).label("tokens"),
            func.sum(case((llm_calls.c.outcome != "cache_hit", llm_calls.c.cost), else_=0.0)).label("spent"),
            func.sum(case((llm_calls.c.outcome == "cache_hit", llm_calls.c.cost), else_=0.0)).label("saved"),
        ).where(where(llm_calls)).group_by(llm_calls.c.pipeline, llm_calls.c.tenant, llm_calls.c.stage,
                                            llm_calls.c.model)
        .order_by(llm_calls.c.pipeline, llm_calls.c.tenant, llm_calls.c.stage, llm_calls.c.model),
        "dead_letters": select(dead_letters.c.pipeline, dead_letters.c.reason, dead_letters.c.status,
                               func.count().label("count"))
        .where(where(dead_letters)).group_by(dead_letters.c.pipeline, dead_letters.c.reason, dead_letters.c.status)
        .order_by(dead_letters.c.pipeline, dead_letters.c.reason),
        "positions": select(source_positions.c.pipeline, source_positions.c.stream, source_positions.c.partition,
                            source_positions.c.next_offset)
        .where(where(source_positions))
        .order_by(source_positions.c.pipeline, source_positions.c.stream, source_positions.c.partition),
    }
    with engine.connect() as conn:
        k = llm_claims.c
        # Live or expired by the database's clock (the one leases are timed by); a worker long gone
        # shows as expired until another worker takes its keys.
        state = case((k.expires_at >= db_now(conn), "live"), else_="expired").label("lease")
        queries["in_flight"] = select(k.pipeline, k.owner.label("worker"), state, func.count().label("claimed_keys")) \
            .where(where(llm_claims)).group_by(k.pipeline, k.owner, state).order_by(k.pipeline, k.owner)
        found = {name: [dict(row) for row in conn.execute(queries[name]).mappings()] for name in NAMES}
    if end_offsets is not None:
        stored = {(r["stream"], r["partition"]): r for r in found["positions"]}
        found["positions"] = [
            {"pipeline": pipeline, "stream": stream, "partition": partition,
             "next_offset": stored.get((stream, partition), {}).get("next_offset", 0), "end_offset": end,
             "lag": end - stored.get((stream, partition), {}).get("next_offset", 0)}
            for (stream, partition), end in sorted(end_offsets.items())
        ]
    return found


def open_dead_letters(engine: Engine, pipeline: str | None, reason: str | None,
                      limit: int) -> tuple[list[dict[str, Any]], int]:
    """(newest open dead letters, how many are open in all) for ``etl dlq list``."""
    if not inspect(engine).has_table("dead_letters"):
        return [], 0
    c = dead_letters.c
    where = [c.status == "open"]
    if pipeline:
        where.append(c.pipeline == pipeline)
    if reason:
        where.append(c.reason == reason)
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(dead_letters).where(*where)).scalar_one()
        found = conn.execute(
            select(c.id, c.pipeline, c.reason, c.stage, c.tenant, c.doc_key, c.stream, c.partition,
                   c.message_offset, c.detail).where(*where).order_by(c.id.desc()).limit(limit)
        ).mappings()
        return [dict(row) for row in found], total
