"""Retention: what no live stage can reach any more, and model-call rows past their retention.

A cache entry is keyed by tenant + stage fingerprint + content: once no stage of any pipeline has
its fingerprint (a changed prompt, schema, model or validator), no look-up can find it again. A
result of a stage that no pipeline has any more is nobody's answer. Both go, with what hangs off
them (an entry's text for the router, a result's typed row: typed rows without a result that
stays go too). A result of a stage that still
exists but was answered under an older fingerprint stays: it is still the document's answer
until the document is processed again (``etl replay`` recomputes it).

The store holds no record of which pipelines use it, so a prune is given all of them, and trusts
that the given files and settings are what runs only once the store shows it (``check``, in the
deleting transaction): no other pipeline's rows, each stage's newest answer at the fingerprint the
files make (they are what ran last), and a stage the files no longer have named explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from datetime import datetime, timedelta, timezone

from sqlalchemy import ColumnElement, Connection, Engine, MetaData, Table, delete, func, inspect, select, tuple_

from connectors.store.tables import cache_texts, llm_cache, llm_calls, metadata, stage_results, typed_table_names


#: pipeline → tenant ("" for every tenant without a configuration of its own) → stage → the
#: fingerprint its documents get there, or the fingerprints (the main model's first, then a
#: budget's fallback model's, whose answers are live too).
Live = Mapping[str, Mapping[str, Mapping[str, str | Sequence[str]]]]


class Refused(Exception):  # noqa: N818 - it says what happened: nothing was deleted
    """Pruning now could delete what a live pipeline uses; nothing was deleted."""


#: Tables whose rows say where a pipeline has been, not what it uses (a retired pipeline whose
#: tenants were purged leaves its positions behind).
_NOT_USE = {"source_positions", "llm_claims"}


def stored_pipelines(conn: Connection) -> set[str]:
    """Pipelines with rows that use the store's answers (results, letters, calls, batches, students,
    …; a pipeline's evals cost under ``<pipeline>#eval``)."""
    names: set[str] = set()
    present = set(inspect(conn).get_table_names())
    for table in metadata.tables.values():
        if "pipeline" in table.c and table.name in present and table.name not in _NOT_USE:
            names.update(conn.execute(select(table.c.pipeline).distinct()).scalars())
    return {name.removesuffix("#eval").removesuffix("#stability") for name in names if name is not None}


def _fingerprints(given: str | Sequence[str] | None) -> set[str]:
    return set() if given is None else {given} if isinstance(given, str) else set(given)


def _configuration(by_tenant: Mapping[str, Mapping[str, str]], tenant: str) -> str:
    return tenant if tenant in by_tenant else ""


def _stage_names(live: Live) -> dict[str, set[str]]:
    """Each pipeline's stage names, over every tenant configuration."""
    return {pipeline: {name for stages in by_tenant.values() for name in stages} for pipeline, by_tenant in live.items()}


def check(conn: Connection, live: Live, drop_stages: Set[str] = frozenset()) -> None:
    """Raises Refused unless the given pipelines are all the store holds, and each is what runs.

    What runs is told by the newest answer each pipeline paid for or reused (its ``llm_calls`` row
    with the highest id, joined to the cache entry that gives its fingerprint) per tenant
    configuration and stage: it must be at the fingerprint ``live`` gives (else the files changed
    and have not run since, an old file or other model settings, ETL_LLM_*, are given). Where no
    such call row is left (pruned by retention), a result at the live fingerprint will do. A stage
    the files no longer have must be named in ``drop_stages`` (bare or as ``pipeline/stage``):
    another worker may still run the old file."""
    others = sorted(stored_pipelines(conn) - set(live))
    if others:
        raise Refused(f"the store also holds pipeline(s) {', '.join(others)}: give their files too (they may use "
                      "cache entries the others do not), or `etl tenant purge` their tenants first")
    c, k, r = llm_calls.c, llm_cache.c, stage_results.c
    # the newest call per fingerprint: a budget's fallback answers some days, and the main model's
    # fingerprint must be proven by the newest call that is not the fallback's
    newest = select(c.pipeline, c.tenant, c.stage, k.fingerprint, func.max(c.id).label("id")).join(
        llm_cache, (k.tenant == c.tenant) & (k.cache_key == c.cache_key)).where(c.pipeline.in_(sorted(live))).group_by(
        c.pipeline, c.tenant, c.stage, k.fingerprint)
    called: dict[tuple[str, str, str], tuple[int, str]] = {}
    for pipeline, tenant, stage, fingerprint, id_ in conn.execute(newest):
        at = (pipeline, _configuration(live[pipeline], tenant), stage)
        given = live[pipeline][at[1]].get(stage)
        fallback = not isinstance(given, str) and given is not None and fingerprint in list(given)[1:]
        rank = (not fallback, id_)  # any call not the fallback's outranks the fallback's
        if at not in called or rank > called[at][0]:
            called[at] = (rank, fingerprint)  # type: ignore[assignment]
    results: dict[tuple[str, str, str], set[str]] = {}
    for pipeline, tenant, stage, fingerprint in conn.execute(
            select(r.pipeline, r.tenant, r.stage, r.fingerprint).where(r.pipeline.in_(sorted(live))).distinct()):
        results.setdefault((pipeline, _configuration(live[pipeline], tenant), stage), set()).add(fingerprint)
    names = _stage_names(live)
    unproven, dropped = [], set()
    for pipeline, configuration, stage in sorted(results.keys() | called.keys()):
        by_tenant = live[pipeline]
        if stage not in names[pipeline]:
            if stage not in drop_stages and f"{pipeline}/{stage}" not in drop_stages:
                dropped.add(f"{pipeline}/{stage}")
            continue
        fingerprints = _fingerprints(by_tenant[configuration].get(stage))
        at = (pipeline, configuration, stage)
        if not fingerprints & ({called[at][1]} if at in called else results.get(at, set())):
            unproven.append(f"{pipeline}/{configuration or 'default configuration'}/{stage}")
    if unproven:
        raise Refused(f"{', '.join(unproven[:5])}{' …' if len(unproven) > 5 else ''}: its newest answer is not at "
                      "the fingerprint the given files make: give the files (and the model settings, ETL_LLM_*) "
                      "that run now, or run them once since they changed; pruning now would delete what runs use")
    if dropped:
        raise Refused(f"{', '.join(sorted(dropped))}: results of a stage the given files no longer have: once no "
                      "worker runs the old files, name each with --drop-stage to delete its results")


def prune(engine: Engine, live: Live, retention_days: float, *, dry_run: bool, drop_stages: Set[str] = frozenset(),
          now: datetime | None = None) -> dict[str, int]:
    """Rows per table that no live stage can reach, and call rows of these pipelines older than
    ``retention_days``: deleted in one transaction unless ``dry_run`` (then only counted), after
    ``check`` in the same transaction (Refused: nothing deleted). ``kept_stale_results`` counts
    results of live stages at an older fingerprint (kept, see the module)."""
    fingerprints = {fp for by_tenant in live.values() for stages in by_tenant.values() for given in stages.values()
                    for fp in _fingerprints(given)}
    if not fingerprints:
        raise ValueError("no live stage fingerprints: every cache entry would look dead")
    stages = _stage_names(live)
    cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=retention_days)
    r = stage_results.c
    counts: dict[str, int] = {}
    # one snapshot for the check and the deletes (PostgreSQL's default gives each statement its own)
    options = {"isolation_level": "REPEATABLE READ"} if engine.dialect.name == "postgresql" else {}
    with engine.connect().execution_options(**options) as conn, conn.begin() as transaction:
        if conn.dialect.name == "postgresql":
            # As the owner: a role under tenant policies would see (and delete) only its tenants'.
            conn.exec_driver_sql("SET LOCAL row_security = off")
        check(conn, live, drop_stages)

        def take(table: Table, where: ColumnElement[bool]) -> None:
            if dry_run:
                n = conn.execute(select(func.count()).select_from(table).where(where)).scalar_one()
            else:
                n = conn.execute(delete(table).where(where)).rowcount
            counts[table.name] = counts.get(table.name, 0) + int(n)

        dead_entry = llm_cache.c.fingerprint.not_in(sorted(fingerprints))
        take(cache_texts, tuple_(cache_texts.c.tenant, cache_texts.c.cache_key).in_(
            select(llm_cache.c.tenant, llm_cache.c.cache_key).where(dead_entry)))
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
        # a pipeline's evals and stability measurements cost under "<pipeline>#eval", "#stability"
        called = [p for pipeline in sorted(stages) for p in (pipeline, f"{pipeline}#eval", f"{pipeline}#stability")]
        take(llm_calls, llm_calls.c.pipeline.in_(called) & (llm_calls.c.created_at < cutoff))
        if dry_run:
            transaction.rollback()
    return counts


def _reflect(conn: Connection, name: str) -> Table:
    return Table(name, MetaData(), autoload_with=conn)
