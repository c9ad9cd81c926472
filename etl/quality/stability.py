"""``etl stability``: how often a stage's model gives the same answer when asked again.

Temperature 0 is not deterministic (batching, hardware, a provider's load), and the cache only
makes a *stored* answer stable. Before a re-extraction, a model upgrade or a golden-set score is
trusted, this measures it: a sample of documents, each asked ``samples`` times through the stage as
a run asks it (its prompt, schema, validators, repairs, chunks), in rounds (every document once,
then again), bypassing the cache for the measurement only: nothing stored is read as an answer or
overwritten. Every attempt is recorded in ``llm_calls`` under the pipeline name + ``#stability``,
so it is costed and kept out of production metrics.

Per tenant × stage × model it reports and stores (``stability_runs``):

- ``unanimous``: the share of documents answered one way every time (Wilson 95% interval);
- ``distinct_answers``: distinct answers per document (1.0: stable);
- per-field agreement: how often a field's value is its document's most common value;
- Classify's ``label_flip_rate``: the chance that two answers to the same document differ in label
  (the chance a re-run changes a stored label);
- ``reproduced``: the share of stored answers (same fingerprint) the model gives again as its most
  common answer.

A run whose unanimous share is lower than the previous run's for the same model by more than
chance (a two-proportion z-test, z > 1.96) is a drift alert (metric ``stability``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine, insert, select

from connectors.sources.base import Source
from connectors.store.sql import migrate as upgrade_schema
from connectors.store.write import members
from connectors.store.tables import documents, drift_alerts, golden_examples, llm_calls, stability_runs, stage_results
from etl.errors import ConfigError, EtlError
from etl.llm.base import LLM
from etl.pipeline import Pipeline
from etl.quality.golden import Answered, ask_afresh, golden_document
from etl.runtime.execute import ModelCalls, StagePlan
from etl.stages import Classify
from schemas import Document

MAX_SAMPLES = 100
#: A two-proportion z above this is a drop in stability beyond chance (95%, one-sided 97.5%).
ALERT_Z = 1.96


def source_documents(pipeline: Pipeline, source: Source, count: int, seed: int = 0) -> list[Document]:
    """``count`` messages drawn evenly at random (reservoir sampling, ``seed``) from a finite
    source (a file, a directory, a JSONL of paths), then decoded (only those: a directory of PDFs
    is not parsed whole); one that does not decode is left out, as a run would dead-letter it."""
    rng, kept, seen = random.Random(seed), [], 0
    source.open(None)  # type: ignore[arg-type]  # a file source never asks its ledger
    empty = 0
    try:
        while (messages := source.poll(500, 0.0)) is not None:
            empty = 0 if messages else empty + 1
            if empty > 100:  # a source that never ends (not a file): what it gave so far
                break
            for message in messages:
                seen += 1
                if len(kept) < count:
                    kept.append(message)
                elif (slot := rng.randrange(seen)) < count:
                    kept[slot] = message
    finally:
        source.close()
    documents = []
    for message in kept:
        try:
            documents.append(pipeline.decoder.decode(message, source.value_format))
        except EtlError:
            continue
    return documents


def golden_documents(engine: Engine, pipeline: str, stage: str, count: int, seed: int = 0) -> list[Document]:
    query = select(golden_examples).where(golden_examples.c.pipeline == pipeline, golden_examples.c.stage == stage)
    with engine.connect() as conn:
        examples = [dict(r) for r in conn.execute(query.order_by(golden_examples.c.id)).mappings()]
    if len(examples) > count:
        examples = random.Random(seed).sample(examples, count)
    return [golden_document(e) for e in examples]


def answer_of(stage: Any, output: dict[str, Any] | None, reason: str | None) -> str:
    """What two answers are compared by: Classify's label (its confidence is not the answer),
    an Extract's whole output; a failure is an answer too (its reason)."""
    if output is None:
        return f"<failed: {reason}>"
    if isinstance(stage, Classify):
        return str(output.get("label"))
    return json.dumps(output, sort_keys=True, ensure_ascii=False)


def field_values(stage: Any, output: dict[str, Any] | None, reason: str | None) -> dict[str, str]:
    if output is None:
        return {}
    if isinstance(stage, Classify):
        return {"label": str(output.get("label"))}
    return {name: json.dumps(value, sort_keys=True, ensure_ascii=False) for name, value in output.items()}


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and a normal-approximation interval (clipped to [0, 1])."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def summarise(stage: Any, answers: Sequence[Sequence[tuple[dict[str, Any] | None, str | None]]],
              stored: Sequence[dict[str, Any] | None] = ()) -> dict[str, Any]:
    """The figures of one measurement: ``answers[d]`` are document d's (output, failure reason)
    over the samples; ``stored[d]`` its stored answer for the same content and fingerprint, if any.

    A document is answered one way only if every sample is a valid answer and all are the same (a
    model that fails every time is not stable: it never answers). The flip rate and field
    agreement are over the valid answers; failures are counted apart."""
    n = len(answers)
    if n == 0:
        raise ConfigError("no documents to measure")
    k = len(answers[0])
    keys = [[answer_of(stage, o, r) for o, r in doc] for doc in answers]
    counts = [Counter(doc) for doc in keys]
    valid = [Counter(answer_of(stage, o, r) for o, r in doc if o is not None) for doc in answers]
    unanimous = sum(len(c) == 1 and sum(c.values()) == k for c in valid)
    flips = [1 - sum(v * (v - 1) for v in c.values()) / (m * (m - 1)) for c in valid if (m := sum(c.values())) > 1]
    fields: dict[str, list[float]] = {}
    names = sorted({name for doc in answers for o, r in doc for name in field_values(stage, o, r)})
    for name in names:
        for doc in answers:
            answered = [field_values(stage, o, r) for o, r in doc if o is not None]
            if answered:
                values = Counter(a.get(name, "<absent>") for a in answered)
                fields.setdefault(name, []).append(values.most_common(1)[0][1] / len(answered))
    agreement = {name: round(sum(v) / len(v), 6) for name, v in fields.items()}
    compared = [(c, answer_of(stage, s, None)) for c, s in zip(counts, stored, strict=False) if s is not None]
    reproduced = sum(c.most_common(1)[0][0] == s for c, s in compared)
    flip, flip_low, flip_high = mean_interval(flips) if flips else (None, None, None)
    low, high = wilson(unanimous, n)
    failed = sum(o is None for doc in answers for o, _ in doc)
    classify = isinstance(stage, Classify)
    return {
        "documents": n, "samples": k, "unanimous": unanimous / n,
        "distinct_answers": sum(len(c) for c in counts) / n,
        "label_flip_rate": flip if classify else None,
        "reproduced": reproduced / len(compared) if compared else None,
        "details": {"unanimous_ci": [low, high], "label_flip_rate_ci": [flip_low, flip_high] if classify and flips
                    else None,
                    "reproduced_ci": list(wilson(reproduced, len(compared))) if compared else None,
                    "stored_compared": len(compared), "fields": agreement, "failed_samples": failed,
                    "failed_share": failed / (n * k), "max_distinct": max(len(c) for c in counts)},
    }


async def measure(engine: Engine, pipeline: Pipeline, llm: LLM, stage_name: str, documents: Sequence[Document],
                  samples: int, *, repairs: int = 1, concurrency: int = 4, max_cost: float | None = None,
                  progress: Callable[[int], None] | None = None, candidate: bool = False,
                  source: str = "") -> list[dict[str, Any]]:
    """Asks ``stage_name``'s model ``samples`` times about each document, per tenant (its own
    stage overrides and model, as its documents run), records and returns one run per tenant.
    ``max_cost`` (USD): a tenant stops after the round that reaches it (two rounds always run, so
    the rounds done are measured) and the tenants after it are not started (``skipped``).
    ``progress`` is told after each answer. ``candidate``: ``llm`` answers for every tenant (a model
    being considered, not the one runs use). ``source`` says where the documents came from: only a
    run of the same fingerprint, samples and source is compared for a drop."""
    stage = next((s for s in pipeline.stages if s.name == stage_name), None)
    if stage is None:
        names = ", ".join(s.name for s in pipeline.stages)
        raise ConfigError(f"pipeline {pipeline.name!r} has no stage {stage_name!r} (its stages: {names})")
    if not 2 <= samples <= MAX_SAMPLES:
        raise ConfigError(f"--samples {samples}: give 2 to {MAX_SAMPLES} answers per document")
    if max_cost is not None and not (math.isfinite(max_cost) and max_cost > 0):
        raise ConfigError(f"--max-cost {max_cost}: give a positive number of USD")
    with engine.begin() as conn:
        upgrade_schema(conn)
    by_tenant: dict[str, list[Document]] = {}
    for doc in documents:
        by_tenant.setdefault(doc.tenant, []).append(doc)
    calls = ModelCalls(repairs=repairs)
    gate = asyncio.Semaphore(concurrency)
    spent = 0.0
    runs = []

    async def ask(plan: StagePlan, doc: Document) -> Answered:
        async with gate:
            answered = await ask_afresh(calls, plan, doc)
        if progress is not None:
            progress(1)
        return answered

    for tenant, docs in sorted(by_tenant.items()):
        if max_cost is not None and spent >= max_cost:
            runs.append({"tenant": tenant, "skipped": f"--max-cost {max_cost:g} USD reached"})
            continue
        own = next(s for s in pipeline.stages_for(tenant) if s.name == stage.name)
        model = llm if candidate else pipeline.tenant_llms.get(tenant, llm)
        plan = StagePlan.of(own, model, repairs)
        stored = _stored(engine, pipeline.name, tenant, own.name, [d.key for d in docs])
        if own.when is not None:  # a conditional stage: measured where it ran, on this very content
            docs = [d for d in docs if d.key in stored and stored[d.key][2] == d.content_hash]
            if not docs:
                continue
        rounds: list[list[Answered]] = []
        while len(rounds) < samples and (max_cost is None or spent < max_cost or len(rounds) < 2):
            answered = list(await asyncio.gather(*(ask(plan, d) for d in docs)))
            spent += sum(c.cost for a in answered for c in a[1])
            rounds.append(answered)
        per_doc = [[(r[i][0], r[i][2]) for r in rounds] for i in range(len(docs))]
        # the stored answer to this content by this fingerprint (its cache key), if there is one
        same = [stored[d.key][1] if d.key in stored and stored[d.key][0] == plan.key(d) else None for d in docs]
        figures = summarise(own, per_doc, same)
        paid = [c for r in rounds for a in r for c in a[1]]
        reported = next((c.model for c in paid if c.outcome == "ok"), model.model_id)
        figures["details"]["source"] = source
        run = {"pipeline": pipeline.name, "tenant": tenant, "stage": own.name, "model": reported,
               "fingerprint": plan.fingerprint, **figures, "calls": sum(c.outcome != "cache_hit" for c in paid),
               "cost": sum(c.cost for c in paid)}
        runs.append(_record(engine, run, paid))
    return runs


def _stored(engine: Engine, pipeline: str, tenant: str, stage: str, keys: list[str]
            ) -> dict[str, tuple[str, dict[str, Any], str]]:
    """doc key → (cache key, output, the stored version's content hash) of its result for ``stage``."""
    c, d = stage_results.c, documents.c
    found: dict[str, tuple[str, dict[str, Any], str]] = {}
    with engine.connect() as conn:
        for (member,) in members(conn, keys, c.doc_key):
            for key, cache_key, output, content in conn.execute(
                    select(c.doc_key, c.cache_key, c.output, d.content_hash).join(
                        documents, (d.pipeline == c.pipeline) & (d.tenant == c.tenant) & (d.doc_key == c.doc_key))
                    .where(c.pipeline == pipeline, c.tenant == tenant, c.stage == stage, member)):
                found[key] = (cache_key, output, content)
    return found


def _record(engine: Engine, run: dict[str, Any], paid: list[Any]) -> dict[str, Any]:
    """The run, its attempts (under ``<pipeline>#stability``) and, if its stability dropped beyond
    chance against the previous run of the same stage and model, a drift alert, in one transaction."""
    c = stability_runs.c
    with engine.begin() as conn:
        # comparable runs only: the same fingerprint (prompt, schema, model name), the same number of
        # samples (unanimity falls with K by construction) and the same documents' source; under
        # one fingerprint a moved alias is exactly what this is to find
        previous = next((r for r in conn.execute(select(c.unanimous, c.documents, c.details).where(
            c.pipeline == run["pipeline"], c.tenant == run["tenant"], c.stage == run["stage"],
            c.fingerprint == run["fingerprint"], c.samples == run["samples"])
            .order_by(c.created_at.desc(), c.id.desc()).limit(50))
            if _details(r.details).get("source", "") == run["details"]["source"]), None)
        run_id = conn.execute(insert(stability_runs).values(**run).returning(stability_runs.c.id)).scalar_one()
        if paid:
            conn.execute(insert(llm_calls), [{"pipeline": f"{run['pipeline']}#stability", **p.model_dump()} for p in paid])
        if previous is not None:
            score = drop_z(previous.unanimous, previous.documents, run["unanimous"], run["documents"])
            run["alert"], run["previous_unanimous"] = score > ALERT_Z, previous.unanimous
            if run["alert"]:  # as etl drift records: crossings only
                conn.execute(insert(drift_alerts).values(
                    pipeline=run["pipeline"], tenant=run["tenant"], stage=run["stage"], metric="stability",
                    baseline=previous.unanimous, recent=run["unanimous"], score=score, threshold=ALERT_Z,
                    window=run["documents"]))
    return {**run, "id": run_id}


def _details(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def drop_z(before: float, n_before: int, now: float, n_now: int) -> float:
    """A two-proportion z of the drop from ``before`` to ``now`` (0 when it rose or held)."""
    pooled = (before * n_before + now * n_now) / (n_before + n_now)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n_before + 1 / n_now))
    if before <= now:
        return 0.0
    return (before - now) / spread if spread > 0 else float(ALERT_Z * 10)
