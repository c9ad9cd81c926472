"""Drift without a deploy: each tenant and stage's most recent window against its first window.

A provider can change a model behind the same name; the outputs tell. Per tenant × stage, the
latest ``window`` results are compared with the first ``window`` (the baseline): label
distribution (PSI), output length, empty-field rate; and, over model attempts, the
validation-failure and refusal rates. Crossing a threshold writes a ``drift_alerts`` row and logs a
structlog warning.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, func, insert, select

from connectors.store.tables import drift_alerts, llm_calls, stage_results
from etl.log import get_logger
from etl.quality.scoring import psi

log = get_logger("etl.quality.drift")


@dataclass(frozen=True)
class Thresholds:
    label_psi: float = 0.2
    output_length_change: float = 0.5  # relative
    empty_field_rate: float = 0.2  # absolute change
    validation_failure_rate: float = 0.1
    refusal_rate: float = 0.05


@dataclass
class Alert:
    tenant: str
    stage: str
    metric: str
    baseline: float
    recent: float
    score: float
    threshold: float
    window: int
    extra: dict[str, Any] = field(default_factory=dict)


def _output(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value)


def _empty_rate(outputs: Sequence[dict[str, Any]]) -> float:
    cells = [v for o in outputs for k, v in o.items() if k != "confidence"]
    return sum(v is None or v == "" or v == [] for v in cells) / len(cells) if cells else 0.0


def _window_metrics(outputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "labels": Counter(o["label"] for o in outputs if "label" in o),
        "length": sum(len(json.dumps(o)) for o in outputs) / len(outputs),
        "empty": _empty_rate(outputs),
    }


def _rate(rows: Sequence[tuple[str, str | None]], errors: set[str]) -> float:
    attempts = [e for outcome, e in rows if outcome != "cache_hit"]
    return sum(e in errors for e in attempts) / len(attempts) if attempts else 0.0


def detect(engine: Engine, pipeline: str, window: int = 200, thresholds: Thresholds = Thresholds()) -> list[Alert]:
    """Checks every tenant × stage with at least two windows of results; records and returns alerts."""
    alerts: list[Alert] = []
    with engine.connect() as conn:
        groups = conn.execute(select(stage_results.c.tenant, stage_results.c.stage).where(
            stage_results.c.pipeline == pipeline).distinct()).all()
        for tenant, stage in groups:
            where = (stage_results.c.pipeline == pipeline, stage_results.c.tenant == tenant,
                     stage_results.c.stage == stage)
            first = [_output(o) for (o,) in conn.execute(
                select(stage_results.c.output).where(*where).order_by(stage_results.c.id).limit(window))]
            last = [_output(o) for (o,) in conn.execute(
                select(stage_results.c.output).where(*where).order_by(stage_results.c.id.desc()).limit(window))]
            total = conn.execute(select(func.count()).select_from(stage_results).where(*where)).scalar_one()
            if total < 2 * window:
                continue
            b, r = _window_metrics(first), _window_metrics(last)
            found = []
            if b["labels"] or r["labels"]:
                # baseline/recent: the share of the baseline's most common label in each window
                top = b["labels"].most_common(1)[0][0] if b["labels"] else ""
                found.append(("label_psi", b["labels"][top] / len(first), r["labels"][top] / len(last),
                              psi(b["labels"], r["labels"]), thresholds.label_psi))
            change = abs(r["length"] - b["length"]) / b["length"] if b["length"] else 0.0
            found.append(("output_length", b["length"], r["length"], change, thresholds.output_length_change))
            found.append(("empty_field_rate", b["empty"], r["empty"], abs(r["empty"] - b["empty"]),
                          thresholds.empty_field_rate))
            call_where = (llm_calls.c.pipeline == pipeline, llm_calls.c.tenant == tenant, llm_calls.c.stage == stage)
            c_first = conn.execute(select(llm_calls.c.outcome, llm_calls.c.error).where(*call_where)
                                   .order_by(llm_calls.c.id).limit(window)).all()
            c_last = conn.execute(select(llm_calls.c.outcome, llm_calls.c.error).where(*call_where)
                                  .order_by(llm_calls.c.id.desc()).limit(window)).all()
            for metric, errors, limit in (
                ("validation_failure_rate", {"schema_invalid", "semantic_invalid"}, thresholds.validation_failure_rate),
                ("refusal_rate", {"refusal"}, thresholds.refusal_rate),
            ):
                rb, rr = _rate(c_first, errors), _rate(c_last, errors)
                found.append((metric, rb, rr, abs(rr - rb), limit))
            for metric, base, recent, score, limit in found:
                if score > limit:
                    alerts.append(Alert(tenant, stage, metric, base, recent, score, limit, window))
    if alerts:
        with engine.begin() as conn:
            conn.execute(insert(drift_alerts), [
                {"pipeline": pipeline, "tenant": a.tenant, "stage": a.stage, "metric": a.metric,
                 "baseline": a.baseline, "recent": a.recent, "score": a.score, "threshold": a.threshold,
                 "window": a.window} for a in alerts])
    for a in alerts:
        log.warning("drift_alert", pipeline=pipeline, tenant=a.tenant, stage=a.stage, metric=a.metric,
                    score=round(a.score, 4), threshold=a.threshold)
    return alerts
