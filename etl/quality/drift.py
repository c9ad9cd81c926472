"""Drift without a deploy: each tenant and stage's most recent window against its first results.

A provider can change a model behind the same name; the outputs tell. Per tenant × stage, at the
fingerprint of its newest result, the latest ``window`` results are compared with the first
``max(window, baseline)`` (the baseline): label distribution (a permutation test, see
:func:`label_shift`), output length, empty-field rate; and, over model attempts since that
fingerprint's first result, the validation-failure and refusal rates; and whether the model
version the provider reports changed under the fingerprint's one model name (``model_version``: a
moved alias). Crossing a threshold writes a ``drift_alerts`` row and logs a structlog warning.

An alert means score > threshold for every metric. For ``label_shift`` the score is −log10 of a
p-value and the threshold −log10 of the significance level (3: p < 0.001), so it is sample-size
aware; the other metrics compare a fixed change, whatever the window.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Engine, func, insert, select

from connectors.store.tables import drift_alerts, llm_calls, stage_results
from etl.errors import ConfigError
from etl.log import get_logger

log = get_logger("etl.quality.drift")


#: More distinct labels than this, or than half the results of the two windows, are free text,
#: not a label mix: label_shift is skipped.
MAX_LABELS = 5000


@dataclass(frozen=True)
class Thresholds:
    label_alpha: float = 0.001  # significance level of label_shift's permutation test
    output_length_change: float = 0.5  # relative
    empty_field_rate: float = 0.2  # absolute change
    validation_failure_rate: float = 0.1
    refusal_rate: float = 0.05

    def __post_init__(self) -> None:
        if not 1e-4 <= self.label_alpha < 1:  # the permutations needed grow as 4 / alpha
            raise ConfigError(f"label_alpha={self.label_alpha}: give a significance level from 0.0001 to below 1")


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
        # a label that is not a string (an Extract field named label) is counted by its JSON
        "labels": Counter(o["label"] if isinstance(o["label"], str) else json.dumps(o["label"], sort_keys=True)
                          for o in outputs if "label" in o),
        "length": sum(len(json.dumps(o)) for o in outputs) / len(outputs),
        "empty": _empty_rate(outputs),
    }


def _xlogx(x: np.ndarray) -> np.ndarray:
    return x * np.log(np.where(x > 0, x, 1))


def label_shift(baseline: Mapping[str, int] | Sequence[str], recent: Mapping[str, int] | Sequence[str],
                permutations: int = 3999, seed: int = 0) -> tuple[float, str]:
    """(p, label): has the label mix of ``recent`` moved from ``baseline``? and the label that moved most.

    Two likelihood-ratio statistics over the 2 × labels table of counts: the G-test of
    homogeneity (sensitive to many small moves) and the largest one-label G (label j against the
    rest: sensitive to one label's share moving, which the first spreads over all labels' degrees
    of freedom). Why not PSI or the chi-square law: over many labels and a small window most
    counts are 0 or 1, where PSI's floor turns sampling noise into scores of 3 to 5 and G is far
    from chi-square. Under "no drift" the two windows are one pool of labels split at random, so
    the baseline's counts are a multivariate hypergeometric draw from the pooled counts: each
    statistic is compared with ``permutations`` such splits (seeded: the same windows give the same
    p), p_s = (1 + #{split >= observed}) / (1 + permutations), and p = min(1, 2 min(p_G, p_max))
    (Bonferroni over the two). p is never below 2 / (1 + permutations).
    """
    b, r = Counter(baseline), Counter(recent)
    labels = list(dict.fromkeys([*b, *r]))  # insertion order, not hash order: a seeded p must not vary
    base = np.array([b[label] for label in labels], dtype=np.int64)
    pooled = base + np.array([r[label] for label in labels], dtype=np.int64)
    n, total = int(base.sum()), int(pooled.sum())
    if not n or n == total:
        return 1.0, ""
    # "count" costs O(total) per split, "marginals" O(labels) with steps about 16 times dearer
    splits = np.random.default_rng(seed).multivariate_hypergeometric(
        pooled, n, size=permutations, method="count" if total <= 16 * len(labels) else "marginals")
    cells = np.vstack([base, splits])  # row 0: the observed split
    # with the margins fixed, G = 2 Σ O ln O + const and each one-label G_j = 2 (x ln x + (n−x) ln(n−x)
    # + (m−x) ln(m−x) + (N−n−m+x) ln(N−n−m+x)) + const_j: only the parts that vary are computed
    omnibus = (_xlogx(cells) + _xlogx(pooled - cells)).sum(-1)
    rest = total - n - pooled + cells
    one = _xlogx(cells) + _xlogx(n - cells) + _xlogx(pooled - cells) + _xlogx(rest)
    one -= _xlogx(pooled) + _xlogx(total - pooled) - _xlogx(np.array(total))  # comparable across labels
    top = one.max(-1)
    ties = 1e-9  # floating sums of the same counts in another order: equal is as extreme
    p_g = (1 + int((omnibus[1:] >= omnibus[0] - ties).sum())) / (1 + permutations)
    p_max = (1 + int((top[1:] >= top[0] - ties).sum())) / (1 + permutations)
    return min(1.0, 2 * min(p_g, p_max)), labels[int(one[0].argmax())]


def _rate(rows: Sequence[tuple[str, str | None]], errors: set[str]) -> float:
    attempts = [e for outcome, e in rows if outcome != "cache_hit"]
    return sum(e in errors for e in attempts) / len(attempts) if attempts else 0.0


#: Results the label mix of a recent window is compared with (the first ones, never overlapping it).
BASELINE = 1000


def _model_version(conn: Any, where: Sequence[Any], alerted: Any) -> tuple[float, float, str, str] | None:
    """Under one fingerprint (one configured model name), the version the provider reported
    changed: (share of the model's answers from the first reported version, share from the newest,
    first, newest), or None. Answers from a moved alias are not the answers the fingerprint stood
    for. A router's student answers are not the provider's; a move already alerted (the newest
    version first seen before ``alerted``, the last model_version alert) is not alerted again."""
    r = stage_results.c
    versions = conn.execute(select(r.model, func.count(), func.min(r.created_at), func.max(r.id))
                            .where(*where, r.answered_by.is_(None)).group_by(r.model)
                            .order_by(func.min(r.created_at), func.max(r.id))).all()
    if len(versions) < 2:
        return None
    first, newest = versions[0], max(versions, key=lambda v: v[3])
    if first[0] == newest[0] or (alerted is not None and _aware(newest[2]) <= _aware(alerted)):
        return None
    answered = sum(v[1] for v in versions)
    return first[1] / answered, newest[1] / answered, first[0], newest[0]


def _aware(moment: Any) -> Any:
    """SQLite gives naive UTC datetimes, PostgreSQL aware ones: compared as aware."""
    from datetime import timezone  # noqa: PLC0415

    return moment.replace(tzinfo=timezone.utc) if getattr(moment, "tzinfo", 1) is None else moment


def detect(engine: Engine, pipeline: str, window: int = 200, thresholds: Thresholds = Thresholds(),
           baseline: int = BASELINE) -> list[Alert]:
    """Checks every tenant × stage with at least two windows of results; records and returns alerts.

    The latest ``window`` results (by last update) are compared with the first ``max(window,
    baseline)`` (fewer where the stage has fewer before its latest window), both at the fingerprint
    of the stage's newest result: a deliberate change of prompt or model is a new reference, not
    drift. A long baseline keeps false alarms at the permutation test's level (its p-value is valid
    for any two sizes) and lets a small window find a moved label — 10 documents of one intent among
    50 cannot stand out against 50 others, but do against 1,000."""
    if window < 1 or baseline < 1:
        raise ValueError(f"window={window}, baseline={baseline}: give positive counts of results")
    alerts: list[Alert] = []
    with engine.connect() as conn:
        groups = conn.execute(select(stage_results.c.tenant, stage_results.c.stage).where(
            stage_results.c.pipeline == pipeline).distinct()).all()
        for tenant, stage in groups:
            r = stage_results.c
            of_stage = (r.pipeline == pipeline, r.tenant == tenant, r.stage == stage)
            newest = (r.updated_at.desc(), r.id.desc())
            where = (*of_stage, r.fingerprint == conn.execute(
                select(r.fingerprint).where(*of_stage).order_by(*newest).limit(1)).scalar_one())
            total = conn.execute(select(func.count()).select_from(stage_results).where(*where)).scalar_one()
            alerted = conn.execute(select(func.max(drift_alerts.c.created_at)).where(
                drift_alerts.c.pipeline == pipeline, drift_alerts.c.tenant == tenant, drift_alerts.c.stage == stage,
                drift_alerts.c.metric == "model_version")).scalar()
            if (moved := _model_version(conn, where, alerted)) is not None:
                alerts.append(Alert(tenant, stage, "model_version", *moved[:2], moved[1], 0.0, window,
                                    {"from": moved[2], "to": moved[3]}))
            if total < 2 * window:
                if total < conn.execute(select(func.count()).select_from(stage_results).where(*of_stage)).scalar_one():
                    # a new fingerprint is a new reference: unchecked until it has two windows
                    log.warning("drift_skipped_new_fingerprint", pipeline=pipeline, tenant=tenant, stage=stage,
                                results=total, needed=2 * window)
                continue
            since = conn.execute(select(func.min(r.created_at)).where(*where)).scalar_one()
            last_ids = select(r.id).where(*where).order_by(*newest).limit(window).scalar_subquery()
            last = [_output(o) for (o,) in conn.execute(select(r.output).where(r.tenant == tenant, r.id.in_(last_ids)))]
            first = [_output(o) for (o,) in conn.execute(select(r.output).where(*where, r.id.not_in(last_ids)).order_by(
                r.id).limit(min(max(window, baseline), total - window)))]
            b, m = _window_metrics(first), _window_metrics(last)
            found = []
            many = len(b["labels"].keys() | m["labels"].keys())
            if many > MAX_LABELS or many > (len(first) + len(last)) / 2:  # free text, not labels
                log.warning("label_shift_skipped", pipeline=pipeline, tenant=tenant, stage=stage, labels=many)
            elif b["labels"] and m["labels"]:
                # baseline/recent: the share, in each window, of the label that moved most; the
                # p-value's floor 2 / (1 + B) is kept at alpha / 2, so that any alpha can be reached
                p, moved = label_shift(b["labels"], m["labels"], max(3999, int(4 / thresholds.label_alpha) - 1))
                found.append(("label_shift", b["labels"][moved] / len(first), m["labels"][moved] / len(last),
                              -math.log10(p), -math.log10(thresholds.label_alpha)))
            # the metrics below compare a fixed change, whatever the window: not yet sample-size aware
            change = abs(m["length"] - b["length"]) / b["length"] if b["length"] else 0.0
            found.append(("output_length", b["length"], m["length"], change, thresholds.output_length_change))
            found.append(("empty_field_rate", b["empty"], m["empty"], abs(m["empty"] - b["empty"]),
                          thresholds.empty_field_rate))
            # the same fingerprint's attempts: those made since its first result (calls have no fingerprint)
            call_where = (llm_calls.c.pipeline == pipeline, llm_calls.c.tenant == tenant, llm_calls.c.stage == stage,
                          llm_calls.c.created_at >= since)
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
                    score=round(a.score, 4), threshold=a.threshold, **a.extra)
    return alerts
