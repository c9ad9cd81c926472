"""Golden sets and evals: labelled examples per tenant and stage, scored against the current stage.

``etl eval`` asks the model afresh (the cache is bypassed: an eval measures the model as it is
today), records every attempt in ``llm_calls`` under the pipeline name + ``#eval`` (so evals are
costed but kept out of production metrics), and stores accuracy per tenant, stage, model and
fingerprint with the per-example results.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, insert, select

from connectors.store.base import CacheEntry
from connectors.store.sql import cache_entries
from connectors.store.sql import migrate as upgrade_schema
from connectors.store.tables import eval_results, eval_runs, golden_examples, llm_cache, llm_calls
from connectors.store.write import upsert
from dedup import content_hash, normalize_content
from dedup import SingleFlight
from etl.confidence import calibration
from etl.errors import ConfigError
from etl.llm.base import LLM
from etl.pipeline import Pipeline
from etl.quality.scoring import classification_scores, extraction_scores, normalize_value
from etl.runtime.decode import MAX_KEY, MAX_TENANT
from etl.runtime.chunks import answer_in_chunks
from etl.runtime.execute import ModelCalls, StageFailed, StagePlan
from etl.stages import Classify
from etl.storable import text_problem, value_problem
from schemas import Document, Position


#: An example's answer: output (None if it failed), the attempts, the failure's reason, the
#: confidence, and the cache entry it is (None if it failed).
Answered = tuple[dict[str, Any] | None, list[Any], str | None, dict[str, list[Any]] | None, CacheEntry | None]


def read_golden(path: Path, default_tenant: str = "default") -> list[dict[str, Any]]:
    """JSONL: ``{"id", "text", "tenant"?, "expected": {...}}`` or ``"label"`` for a classify stage.
    Every line is checked; any reject fails the whole file (nothing is imported), naming each
    rejected line."""
    examples: list[dict[str, Any]] = []
    rejects: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="surrogateescape").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            example = _golden_line(line, default_tenant)
        except ValueError as exc:
            rejects.append(f"line {number}: {exc}")
            continue
        ref = (example["tenant"], example["doc_key"])
        if ref in seen:
            rejects.append(f"line {number}: id {ref[1]!r} of tenant {ref[0]!r} is also on line {seen[ref]}")
            continue
        seen[ref] = number
        examples.append(example)
    if rejects:
        shown = "; ".join(rejects[:10]) + (f"; and {len(rejects) - 10} more" if len(rejects) > 10 else "")
        raise ConfigError(f"{path}: {len(rejects)} line(s) rejected, nothing imported: {shown}")
    return examples


def _golden_line(line: str, default_tenant: str) -> dict[str, Any]:
    """One example from one line, or a ValueError saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    key, content, tenant = row.get("id"), row.get("text"), row.get("tenant") or default_tenant
    if isinstance(key, bool) or not isinstance(key, (str, int)) or key == "":
        raise ValueError("needs an id (a string or an integer)")
    key = str(key)
    if not isinstance(content, str) or not content.strip():
        raise ValueError("needs a text (a non-empty string)")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string")
    if "expected" in row:
        expected = row["expected"]
        if not isinstance(expected, dict) or not expected:
            raise ValueError("expected must be a non-empty JSON object")
    elif isinstance(row.get("label"), str) and row["label"]:
        expected = {"label": row["label"]}
    else:
        raise ValueError("needs expected (an object) or label (a string)")
    for what, value, limit in (("id", key, MAX_KEY), ("tenant", tenant, MAX_TENANT), ("text", content, None)):
        if limit is not None and len(value) > limit:
            raise ValueError(f"{what} is longer than {limit} characters")
        if (problem := text_problem(value)) is not None:
            raise ValueError(f"{what} {problem}")
    if (problem := value_problem(expected, "expected")) is not None:
        raise ValueError(problem)
    return {"doc_key": key, "content": content, "expected": expected, "tenant": tenant}


def import_golden(engine: Engine, pipeline: str, stage: str, examples: Iterable[dict[str, Any]],
                  origin: str = "import") -> int:
    """Upserts examples (the same id replaces its expected answer); returns how many."""
    with engine.begin() as conn:
        upgrade_schema(conn)
        return store_golden(conn, pipeline, stage, examples, origin)


def store_golden(conn: Connection, pipeline: str, stage: str, examples: Iterable[dict[str, Any]],
                 origin: str = "import") -> int:
    """:func:`import_golden` inside the caller's transaction."""
    rows = [{"pipeline": pipeline, "stage": stage, "origin": origin, **e} for e in examples]
    upsert(conn, golden_examples, rows, ("tenant", "pipeline", "stage", "doc_key"), "expected")
    return len(rows)


async def evaluate(engine: Engine, pipeline: Pipeline, llm: LLM, stage_name: str | None = None,
                   tenant: str | None = None, concurrency: int = 8, repairs: int = 1,
                   cache: bool = False, every_tenant: bool = False) -> list[dict[str, Any]]:
    """Runs each stage with golden examples over them, per tenant, as that tenant's documents run
    (its overrides, its model, ``repairs`` as the runs have it: the same fingerprint); returns the
    recorded runs.

    For ``etl eval --models``: ``cache``: answers are cached by the stage fingerprint they are
    made with, as a run's are (a re-run of a comparison asks nothing already answered);
    ``every_tenant``: ``llm`` (a candidate) answers for every tenant, a tenant's own model aside."""
    stages = [s for s in pipeline.stages if stage_name in (None, s.name)]
    if not stages:
        raise ConfigError(f"pipeline {pipeline.name!r} has no stage {stage_name!r}")
    runs = []
    for stage in stages:
        query = select(golden_examples).where(golden_examples.c.pipeline == pipeline.name,
                                              golden_examples.c.stage == stage.name)
        if tenant:
            query = query.where(golden_examples.c.tenant == tenant)
        with engine.connect() as conn:
            examples = [dict(r) for r in conn.execute(query.order_by(golden_examples.c.id)).mappings()]
        if isinstance(stage, Classify) and (unlabelled := [e["doc_key"] for e in examples
                                                           if not isinstance(e["expected"].get("label"), str)]):
            raise ConfigError(f"{pipeline.name}/{stage.name} is a Classify stage, but {len(unlabelled)} golden "
                              f"example(s) expect no label (e.g. id {unlabelled[0]!r}): import them again with "
                              '"label" (or "expected": {"label": ...})')
        by_tenant: dict[str, list[dict[str, Any]]] = {}
        for example in examples:
            by_tenant.setdefault(example["tenant"], []).append(example)
        calls = ModelCalls(repairs=repairs)
        gate = asyncio.Semaphore(concurrency)

        async def answer(plan: StagePlan, doc: Document, key: str, hits: dict[str, CacheEntry]) -> Answered:
            if (hit := hits.get(key)) is not None:
                return hit.output, [], None, hit.confidence, hit
            async with gate:
                return await ask_afresh(calls, plan, doc)

        for tenant_name, items in sorted(by_tenant.items()):
            # The tenant's stage and model, as its documents run (its overrides, its own model).
            own = next(s for s in pipeline.stages_for(tenant_name) if s.name == stage.name)
            model = llm if every_tenant else pipeline.tenant_llms.get(tenant_name, llm)
            plan = StagePlan.of(own, model, repairs)
            docs = [golden_document(e) for e in items]
            keys = [plan.key(doc) for doc in docs]
            hits = _cached(engine, keys) if cache else {}
            answers = await asyncio.gather(*(answer(plan, d, k, hits) for d, k in zip(docs, keys, strict=True)))
            runs.append(_record(engine, pipeline.name, tenant_name, own, plan, model, items, answers, keys,
                                cache=cache))
    return runs


def _cached(engine: Engine, keys: list[str]) -> dict[str, CacheEntry]:
    with engine.connect() as conn:
        return cache_entries(conn, keys)


def golden_document(example: dict[str, Any]) -> Document:
    """The example as a run decodes a document: its text normalized as it is hashed, so the model
    reads what the cache key stands for."""
    content = normalize_content(example["content"])
    return Document(tenant=example["tenant"], key=example["doc_key"], content=content,
                    content_hash=content_hash(content), position=Position(stream="golden", offset=example["id"]))


async def ask_afresh(calls: ModelCalls, plan: StagePlan, doc: Document) -> Answered:
    """The stage's answer for ``doc`` as a run would give it (a long document in chunks), from the
    model and never from the cache (an eval or a stability measurement)."""
    parts = plan.chunks(doc.content)
    try:
        if len(parts) > 1:
            computed = await answer_in_chunks(SingleFlight(), calls, plan, doc, plan.key(doc),
                                              plan.stage.chunks_to_ask(parts))
        else:
            computed = await calls.compute(plan, doc)
        return computed.entry.output, computed.calls, None, computed.entry.confidence, computed.entry
    except StageFailed as failed:
        return None, failed.calls, failed.reason, None, None


def confidence_pairs(stage: Any, expected: dict[str, Any], predicted: dict[str, Any] | None,
                     confidence: dict[str, list[Any]] | None) -> list[tuple[float, bool, str]]:
    """(confidence, correct, source) per scored value: a Classify answer's label, an Extract
    answer's top-level scalar fields that have a confidence (compared as the scores compare them)."""
    if predicted is None:
        return []
    if isinstance(stage, Classify):
        sure = predicted.get("confidence")
        source = (confidence or {}).get("label", [None, "backend"])[1]
        return [] if sure is None else [(float(sure), predicted["label"] == expected["label"], source)]
    pairs = []
    for name, want in expected.items():
        if isinstance(want, (dict, list)) or name not in (confidence or {}):
            continue
        sure, source = confidence[name]  # type: ignore[index]
        pairs.append((float(sure), normalize_value(predicted.get(name)) == normalize_value(want), source))
    return pairs


def _record(engine: Engine, pipeline: str, tenant: str, stage: Any, plan: StagePlan, llm: LLM,
            items: list[dict[str, Any]], answers: list[Answered], keys: list[str],
            cache: bool = False) -> dict[str, Any]:
    """The run and its per-example results; its attempts under ``<pipeline>#eval``; with ``cache``,
    the answers made now in ``llm_cache`` (first answer wins, as in a run)."""
    expected = [e["expected"] for e in items]
    predicted = [a[0] for a in answers]
    if isinstance(stage, Classify):
        scores = classification_scores([e["label"] for e in expected], [p["label"] if p else None for p in predicted])
        correct = [p is not None and p["label"] == e["label"] for e, p in zip(expected, predicted, strict=True)]
        details: dict[str, Any] = {"confusions": scores["confusions"]}
        from etl.quality.router import score_student  # noqa: PLC0415

        student = score_student(engine, pipeline, tenant, stage, plan.fingerprint, items,
                                [p["label"] if p else None for p in predicted])
        if student is not None:
            details["student"] = student
    else:
        scores = extraction_scores(expected, predicted)
        correct = [extraction_scores([e], [p])["accuracy"] == 1.0 for e, p in zip(expected, predicted, strict=True)]
        details = {"fields": scores["fields"]}
    pairs = [pair for e, a in zip(expected, answers, strict=True) for pair in confidence_pairs(stage, e, a[0], a[3])]
    if pairs:
        details["calibration"] = {**calibration((p, ok) for p, ok, _ in pairs),
                                  "sources": dict(Counter(source for _, _, source in pairs))}
    model = next((c.model for a in answers for c in a[1] if c.outcome == "ok"), None) or next(
        (a[4].model for a in answers if a[4] is not None), llm.model_id)
    run = {"pipeline": pipeline, "tenant": tenant, "stage": stage.name, "model": model,
           "fingerprint": plan.fingerprint, "examples": len(items), "failed": sum(a[2] is not None for a in answers),
           "accuracy": scores["accuracy"], "macro_f1": scores.get("macro_f1"), "details": details}
    with engine.begin() as conn:
        run_id = conn.execute(insert(eval_runs).values(**run).returning(eval_runs.c.id)).scalar_one()
        conn.execute(insert(eval_results), [
            {"run_id": run_id, "tenant": tenant, "doc_key": e["doc_key"], "expected": e["expected"],
             "predicted": a[0], "correct": ok, "error": a[2]}
            for e, a, ok in zip(items, answers, correct, strict=True)])
        calls = [{"pipeline": f"{pipeline}#eval", **c.model_dump()} for a in answers for c in a[1]]
        if calls:
            conn.execute(insert(llm_calls), calls)
        if cache:
            fresh = {a[4].cache_key: vars(a[4]) for a in answers if a[4] is not None and a[1]}
            upsert(conn, llm_cache, list(fresh.values()), ("tenant", "cache_key"), None)
    # not stored, what a comparison of models reads back (etl.quality.compare): what answering the set
    # costs with this model — each answer's own cost (a cached one's as it was paid, a long
    # document's with its chunks), and a failed one's attempts
    cost = sum(a[4].cost if a[4] is not None else sum(c.cost for c in a[1]) for a in answers)
    return {**run, "id": run_id, "cache_keys": keys, "calls_now": sum(len(a[1]) for a in answers), "answer_cost": cost}
