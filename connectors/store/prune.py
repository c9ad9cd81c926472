"""Retention: what no live stage can reach any more, and model-call rows past their retention.

A cache entry is keyed by tenant + stage fingerprint + content: once no stage of any pipeline has
its fingerprint (a changed prompt, schema, model or validator), no look-up can find it again. A
result of a stage that no pipeline has any more is nobody's answer. Both go, with what hangs off
them (an entry's text for the router, a result's typed row: typed rows without a result that
stays go too). A result of a stage that still
exists but was answered under an older fingerprint stays: it is still the document's answer
until the document is processed again (``etl replay`` recomputes it).

The store holds no record of which pipelines use it, so a prune is given all of them: the
caller refuses to run when the store holds results of a pipeline it was not given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone

from sqlalchemy import ColumnElement, Connection, Engine, MetaData, Table, delete, func, inspect, select

from connectors.store.tables import cache_texts, llm_cache, llm_calls, metadata, stage_results, typed_table_names


def stored_pipelines(engine: Engine) -> set[str]:
    """Pipelines with any row in the store (results, letters, calls, batches, students, …; a
    pipeline's evals cost under ``<pipeline>#eval``)."""
    names: set[str] = set()
    with engine.connect() as conn:
        present = set(inspect(conn).get_table_names())
        for table in metadata.tables.values():
            if "pipeline" in table.c and table.name in present:
                names.update(conn.execute(select(table.c.pipeline).distinct()).scalars())
    return {name.removesuffix("#eval") for name in names if name is not None}


def unproven_stages(engine: Engine, live: Callable[[str, str], set[str]], stages: set[str]) -> list[str]:
    """``tenant/stage`` pairs (live stages only) that have cache entries, none of them at a
    fingerprint ``live(tenant, stage)`` gives: the pipeline changed and has not run since for that
    tenant, or it runs with another model or settings than the ones given (ETL_LLM_*). Pruning
    then would drop what its runs use."""
    c = llm_cache.c
    cached: dict[tuple[str, str], set[str]] = {}
    with engine.connect() as conn:
        for tenant, stage, fingerprint in conn.execute(select(c.tenant, c.stage, c.fingerprint).where(
                c.stage.in_(sorted(stages))).distinct()):
            cached.setdefault((tenant, stage), set()).add(fingerprint)
    return sorted(f"{tenant}/{stage}" for (tenant, stage), found in cached.items() if not found & live(tenant, stage))


def prune(engine: Engine, stages: Mapping[str, set[str]], fingerprints: set[str], retention_days: float, *,
          dry_run: bool, now: datetime | None = None) -> dict[str, int]:
    """Rows per table that no live stage can reach, and call rows of these pipelines older than
    ``retention_days``: deleted in one transaction unless ``dry_run`` (then only counted).

    ``stages``: each pipeline's stage names (every tenant's); ``fingerprints``: every stage
    fingerprint the pipelines use, for every tenant configuration. ``kept_stale_results`` counts
    results of live stages at an older fingerprint (kept, see the module)."""
    if not fingerprints:
        raise ValueError("no live stage fingerprints: every cache entry would look dead")
    cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=retention_days)
    r = stage_results.c
    counts: dict[str, int] = {}
    with engine.connect() as conn, conn.begin() as transaction:
        if conn.dialect.name == "postgresql":
            # As the owner: a role under tenant policies would see (and delete) only its tenants'.
            conn.exec_driver_sql("SET LOCAL row_security = off")

        def take(table: Table, where: ColumnElement[bool]) -> None:
            if dry_run:
                n = conn.execute(select(func.count()).select_from(table).where(where)).scalar_one()
            else:
                n = conn.execute(delete(table).where(where)).rowcount
            counts[table.name] = counts.get(table.name, 0) + int(n)

        dead_entry = llm_cache.c.fingerprint.not_in(sorted(fingerprints))
        take(cache_texts, cache_texts.c.cache_key.in_(select(llm_cache.c.cache_key).where(dead_entry)))
        take(llm_cache, dead_entry)
        typed = [_reflect(conn, name) for name in typed_table_names(conn)]
        for pipeline, names in sorted(stages.items()):
            for table in typed:
                # a typed row is its result's: without a result that stays, it goes (a run that
                # drops a stage deletes its results but cannot know its table: those rows too)
                t = table.c
                kept = select(r.id).where(r.pipeline == pipeline, r.tenant == t.tenant, r.doc_key == t.doc_key,
                                          r.cache_key == t.cache_key, r.stage.in_(sorted(names)))
                take(table, (t.pipeline == pipeline) & ~kept.exists())
            take(stage_results, (r.pipeline == pipeline) & r.stage.not_in(sorted(names)))
            counts["kept_stale_results"] = counts.get("kept_stale_results", 0) + int(conn.execute(
                select(func.count()).select_from(stage_results).where(
                    r.pipeline == pipeline, r.stage.in_(sorted(names)), r.fingerprint.not_in(sorted(fingerprints)))
            ).scalar_one())
        # a pipeline's evals cost under "<pipeline>#eval"
        called = [p for pipeline in sorted(stages) for p in (pipeline, f"{pipeline}#eval")]
        take(llm_calls, llm_calls.c.pipeline.in_(called) & (llm_calls.c.created_at < cutoff))
        if dry_run:
            transaction.rollback()
    return counts


def _reflect(conn: Connection, name: str) -> Table:
    return Table(name, MetaData(), autoload_with=conn)
