"""``etl eval --models A,B``: candidate models side by side on the golden set, before a switch.

Every candidate answers the same golden examples through the same stage (prompt, schema,
validators, repairs, chunks), so the only difference is the model. Answers are cached by the
stage fingerprint each candidate makes (as a run caches them), so a re-run asks nothing already
answered. Per candidate: accuracy with its Wilson 95% interval, macro-F1 (Classify) or the mean
field match rate (Extract), what answering the set costs, median latency, the share of examples
whose first answer did not match the schema, and the stability ``etl stability`` last measured for
that fingerprint. The best two are compared by an exact McNemar test on the examples both answered
(paired: the same examples, so per-example disagreements decide, not two separate accuracies).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sqlalchemy import Engine, select

from connectors.store.tables import eval_results, llm_calls, stability_runs
from connectors.store.write import members
from etl.errors import ConfigError
from etl.llm.base import LLM
from etl.pipeline import Pipeline
from etl.quality.golden import evaluate
from etl.quality.scoring import classification_scores
from etl.quality.stability import wilson
from etl.settings import Settings
from etl.stages import Classify


def candidates(pipeline: Pipeline, names: list[str], settings: Settings) -> dict[str, LLM]:
    """Each name: one of the pipeline's ``models``, ``default`` (the model its runs use), or a model
    of the ``ETL_LLM_BASE_URL`` endpoint asked by that name."""
    if len(names) < 2 or len(set(names)) != len(names):
        raise ConfigError(f"--models {','.join(names)}: name two or more different models")
    return {name: candidate(pipeline, name, settings) for name in names}


def candidate(pipeline: Pipeline, name: str, settings: Settings) -> LLM:
    from etl.runtime.wiring import default_llm, priced  # noqa: PLC0415

    if name in pipeline.models:
        return priced(pipeline.models[name], settings)
    if name == "default":
        return priced(pipeline.llm or default_llm(settings), settings)
    if settings.llm_base_url:
        from etl.llm.openai_compat import OpenAICompatibleLLM  # noqa: PLC0415

        return priced(OpenAICompatibleLLM(settings.llm_base_url, name, api_key=settings.llm_api_key,
                                          structured=settings.llm_structured, timeout_s=settings.llm_timeout_s),
                      settings)
    declared = ", ".join(sorted(pipeline.models)) or "none declared"
    raise ConfigError(f"model {name!r} is not one of {pipeline.name!r}'s models ({declared}; Pipeline(models={{...}})) "
                      "nor 'default', and ETL_LLM_BASE_URL is not set to ask an endpoint for it")


async def compare(engine: Engine, pipeline: Pipeline, models: dict[str, LLM], stage: str, tenant: str | None = None,
                  repairs: int = 1) -> dict[str, Any]:
    """Evaluates every candidate (recorded as eval runs) and returns ``{"rows": [...], "test": ...}``
    ordered best first."""
    target = next((s for s in pipeline.stages if s.name == stage), None)
    if target is None:
        raise ConfigError(f"pipeline {pipeline.name!r} has no stage {stage!r} (its stages: "
                          f"{', '.join(s.name for s in pipeline.stages)})")
    rows, outcomes = [], {}
    for name, llm in models.items():
        # 'default' is the model runs use: each tenant's own where it has one
        runs = await evaluate(engine, pipeline, llm, stage, tenant, repairs=repairs, cache=True,
                              every_tenant=name != "default")
        if not runs:
            raise ConfigError(f"no golden examples for {pipeline.name}/{stage}: import some with `etl golden import`")
        row, outcome = _figures(engine, pipeline.name, target, name, runs)
        rows.append(row)
        outcomes[name] = outcome
    rows.sort(key=lambda r: (-r["accuracy"], r["cost"]))
    test = None
    if len(rows) >= 2:
        a, b = rows[0]["candidate"], rows[1]["candidate"]
        test = {"best": a, "second": b, **mcnemar(outcomes[a], outcomes[b])}
    return {"rows": rows, "test": test}


def _figures(engine: Engine, pipeline: str, stage: Any, name: str, runs: list[dict[str, Any]]
             ) -> tuple[dict[str, Any], dict[tuple[str, str], bool]]:
    ids = [r["id"] for r in runs]
    with engine.connect() as conn:
        results = conn.execute(select(eval_results.c.tenant, eval_results.c.doc_key, eval_results.c.expected,
                                      eval_results.c.predicted, eval_results.c.correct)
                               .where(eval_results.c.run_id.in_(ids))).all()
        fingerprints = {r["fingerprint"] for r in runs}
        # latency and the first answer's validity: every attempt made for these answers' keys (this
        # model on these prompts, now or in an earlier eval); a long document's chunk attempts are
        # under the chunks' keys and not counted here
        keys = sorted({k for r in runs for k in r["cache_keys"]})
        attempts = [a for (member,) in members(conn, keys, llm_calls.c.cache_key) for a in conn.execute(
            select(llm_calls.c.cache_key, llm_calls.c.outcome, llm_calls.c.error, llm_calls.c.cost,
                   llm_calls.c.latency_ms).where(llm_calls.c.pipeline == f"{pipeline}#eval", member)
            .order_by(llm_calls.c.id))]
        steady = conn.execute(select(stability_runs.c.unanimous, stability_runs.c.documents).where(
            stability_runs.c.pipeline == pipeline, stability_runs.c.stage == stage.name,
            stability_runs.c.fingerprint.in_(fingerprints)).order_by(stability_runs.c.created_at.desc())).first()
    n = len(results)
    correct = sum(bool(r.correct) for r in results)
    low, high = wilson(correct, n)
    if isinstance(stage, Classify):
        quality = classification_scores([r.expected.get("label") for r in results],
                                        [r.predicted.get("label") if r.predicted else None for r in results])["macro_f1"]
    else:
        fields = [f["normalized"] for r in runs for f in r["details"]["fields"].values()]
        quality = statistics.fmean(fields) if fields else None
    first_invalid: dict[str, bool] = {}
    for key, outcome, error, *_ in attempts:
        if outcome == "retry":  # not an answer: the first answer decides
            continue
        first_invalid.setdefault(key, outcome in ("repair", "failed") and error == "schema_invalid")
    latencies = sorted(a.latency_ms for a in attempts if a.outcome == "ok")
    row = {"candidate": name, "model": runs[0]["model"], "examples": n, "accuracy": correct / n if n else 0.0,
           "accuracy_ci": [low, high], "quality": quality, "failed": sum(r["failed"] for r in runs),
           "cost": sum(r["answer_cost"] for r in runs), "calls_now": sum(r["calls_now"] for r in runs),
           "latency_p50_ms": latencies[len(latencies) // 2] if latencies else None,
           "schema_invalid": sum(first_invalid.values()) / len(first_invalid) if first_invalid else 0.0,
           "stability": None if steady is None else steady.unanimous}
    return row, {(r.tenant, r.doc_key): bool(r.correct) for r in results}


def mcnemar(a: dict[tuple[str, str], bool], b: dict[tuple[str, str], bool]) -> dict[str, Any]:
    """The exact (binomial) McNemar test on the examples both answered: ``a_only`` right only for
    a, ``b_only`` only for b; ``p`` two-sided."""
    common = a.keys() & b.keys()
    a_only = sum(a[k] and not b[k] for k in common)
    b_only = sum(b[k] and not a[k] for k in common)
    n, low = a_only + b_only, min(a_only, b_only)
    # the binomial tail in log space: linear in the discordant pairs, exact to float precision
    log_terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2)
                 for i in range(low + 1)]
    top = max(log_terms, default=0.0)
    p = 1.0 if n == 0 else min(1.0, 2 * math.exp(top) * sum(math.exp(t - top) for t in log_terms))
    return {"examples": len(common), "a_only": a_only, "b_only": b_only, "p": p}
