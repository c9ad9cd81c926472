"""The router: a Classify stage's own cache, distilled into a student that answers the documents
it is sure about, gated, watched and switched off by the store.

- ``etl distill`` (:func:`distill`) trains a student per pipeline × stage × tenant on that
  tenant's LLM answers at the stage's *current* fingerprint, certifies a confidence threshold on
  labelled documents it did not train on (the tenant's golden set, else held-out LLM answers),
  and activates it only if the one-sided lower bound meets the target with non-zero coverage.
  Students are never pooled across tenants: one tenant's documents never answer another's.
- At run time (:class:`Students`), a document the student is sure about gets its label as the
  result (``answered_by`` = the student, cost 0); the rest go to the LLM, and their answers (with
  their text, in ``cache_texts``) are the next student's training set.
- Shadow checks: a deterministic sample of the student's documents (by cache key) is also asked of
  the LLM (whose answer is the stored result). Over the last ``min_checks`` and the last ``window``
  checks, if the agreement seen is improbable (p < ``alpha``/2 each, one-sided binomial) under the
  agreement the gate certified (its lower bound on held-out LLM answers), the student is switched off and a ``drift_alerts``
  row says why; traffic returns to the LLM until ``etl distill`` passes a new student.
"""

from __future__ import annotations

import collections
import itertools
import math
import random
import re
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from sqlalchemy import Engine, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from connectors.store.sql import cache_entries
from connectors.store.tables import cache_texts, drift_alerts, eval_runs, golden_examples, llm_cache, router_checks, \
    students
from dedup import cache_key, content_hash
from etl.errors import ConfigError, EtlError
from etl.log import get_logger
from etl.stages import Classify, StagePlan
from etl.stages.routing import Router

if TYPE_CHECKING:  # numpy, scipy and scikit-learn load only where a student is trained or used
    from etl.quality.student import Certificate, Student

log = get_logger("etl.quality.router")


# -- distillation -------------------------------------------------------------------------------

@dataclass
class Distilled:
    """What ``etl distill`` made of one tenant's stage."""

    tenant: str
    stage: str
    fingerprint: str
    status: str  # active | refused
    reason: str
    student_id: int | None = None
    version: int = 0
    row: dict[str, Any] = field(default_factory=dict)


#: Fewest LLM answers worth distilling, and fewest held-out ones above the threshold to watch.
MIN_ANSWERS = 200
MIN_AGREEMENT_N = 30


def distill(engine: Engine, pipeline: Any, llm: Any, stage_name: str, tenant: str | None = None,
            target: float | None = None, level: float = 0.95, repairs: int = 1, min_golden: int = 200,
            seed: int = 0) -> list[Distilled]:
    """Trains, certifies and records a student per tenant (or only ``tenant``); see the module."""
    stage = next((s for s in pipeline.stages if s.name == stage_name), None)
    if stage is None:
        raise ConfigError(f"pipeline {pipeline.name!r} has no stage {stage_name!r}")
    if not isinstance(stage, Classify):
        raise ConfigError(f"stage {stage_name!r} is a {type(stage).__name__}: only Classify stages have students")
    if target is not None and not 0.0 < target <= 1.0:
        raise ConfigError(f"--target {target}: give a share between 0 and 1")
    with engine.connect() as conn:
        tenants = [tenant] if tenant else sorted(conn.execute(
            select(llm_cache.c.tenant).join(cache_texts, (cache_texts.c.tenant == llm_cache.c.tenant)
                                          & (cache_texts.c.cache_key == llm_cache.c.cache_key))
            .where(llm_cache.c.stage == stage_name).distinct()).scalars())
    made = []
    for name in tenants:
        own = next(s for s in pipeline.stages_for(name) if s.name == stage_name)
        plan = StagePlan.of(own, pipeline.tenant_llms.get(name, llm), repairs)
        made.append(_distill_one(engine, pipeline.name, own, plan.fingerprint, name, target, level, min_golden, seed))
    return made


def _distill_one(engine: Engine, pipeline: str, stage: Any, fingerprint: str, tenant: str, target: float | None,
                 level: float, min_golden: int, seed: int) -> Distilled:
    from etl.quality.student import Student, certify, lower_bound  # noqa: PLC0415
    c, t, g = llm_cache.c, cache_texts.c, golden_examples.c
    with engine.connect() as conn:
        answers = conn.execute(select(t.content, c.output, c.cost).join(cache_texts, (t.tenant == c.tenant) & (t.cache_key == c.cache_key))
                               .where(c.tenant == tenant, c.fingerprint == fingerprint)
                               .order_by(c.cache_key)).all()
        golden = conn.execute(select(g.content, g.expected).where(
            g.pipeline == pipeline, g.tenant == tenant, g.stage == stage.name).order_by(g.id)).all()
    golden = [(content, expected["label"]) for content, expected in golden
              if isinstance(expected, dict) and isinstance(expected.get("label"), str)]
    # the golden set is never trained on, nor are its near-duplicates (the same words in another case
    # or punctuation, which the student's features barely tell apart)
    golden_keys = {_near(content) for content, _ in golden}
    examples = [(content, output["label"], cost) for content, output, cost in answers
                if _near(content) not in golden_keys]
    base = Distilled(tenant, stage.name, fingerprint, "refused", "")
    if len(examples) < MIN_ANSWERS:
        base.reason = (f"{len(examples)} stored LLM answer(s) at fingerprint {fingerprint[:12]} (need {MIN_ANSWERS}): "
                       "run the stage with its router on first, so answers keep their text")
        return _record(engine, pipeline, base, None, None)
    # held out by groups of near-duplicates: no held-out text has a twin in training
    groups: dict[str, list[tuple[str, str, float]]] = {}
    for example in examples:
        groups.setdefault(_near(example[0]), []).append(example)
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    held = max(MIN_AGREEMENT_N * 2, min(1000, len(examples) // 10))
    held_out: list[tuple[str, str, float]] = []
    train: list[tuple[str, str, float]] = []
    for near in order:  # a big group of copies would count one text many times in the held-out slice
        big = len(groups[near]) > max(1, held // 100)
        (held_out if len(held_out) < held and not big else train).extend(groups[near])
    started = time.perf_counter()
    try:
        student = Student.train([x for x, _, _ in train], [y for _, y, _ in train], seed=seed)
    except ValueError as exc:
        base.reason = str(exc)
        return _record(engine, pipeline, base, None, None)
    trained_s = time.perf_counter() - started
    labels, confidence = student.predict([x for x, _, _ in held_out])
    agrees = [a == y for a, (_, y, _) in zip(labels, held_out, strict=True)]
    if len(golden) >= min_golden:
        holdout = "golden"
        if target is None:
            llm_accuracy, why = _llm_accuracy(engine, pipeline, stage.name, tenant, fingerprint, golden, min_golden)
            if llm_accuracy is None:
                base.reason = why
                return _record(engine, pipeline, base, None, None)
            target = max(0.0, llm_accuracy - 0.01)
        g_labels, g_conf = student.predict([x for x, _ in golden])
        cert = certify(g_conf, [a == y for a, (_, y) in zip(g_labels, golden, strict=True)], target, level)
    else:
        holdout = "llm"
        target = 0.90 if target is None else target
        cert = certify(confidence, agrees, target, level)
    base.row = {"trained_on": len(train), "holdout": holdout, "target": target, "level": level,
                "train_s": round(trained_s, 1), "mean_cost": sum(cost for _, _, cost in train) / len(train)}
    if cert.threshold is None:
        base.reason = (f"no threshold reaches {target:.3f} at {level:.0%} confidence on {cert.slice} held-out "
                       f"{'golden' if holdout == 'golden' else 'LLM'} documents; the stage stays with the LLM")
        return _record(engine, pipeline, base, student, cert)
    above = [ok for ok, conf in zip(agrees, confidence, strict=True) if conf >= cert.threshold]
    if len(above) < MIN_AGREEMENT_N:
        base.reason = (f"only {len(above)} held-out LLM answers above the threshold (need {MIN_AGREEMENT_N}) to "
                       "watch the student by: distill again when more answers are stored")
        return _record(engine, pipeline, base, student, cert)
    # A target the LLM itself barely meets (a teacher that answers at random) is no evidence the
    # student learned anything: it must also agree with the LLM more than always answering the
    # most common label would, by its lower bound.
    chance = collections.Counter(y for _, y, _ in held_out).most_common(1)[0][1] / len(held_out)
    if lower_bound(sum(above), len(above), level) <= chance:
        base.reason = (f"held-out agreement with the LLM {sum(above)}/{len(above)} is no better than always answering "
                       f"its most common label ({chance:.3f}) at {level:.0%} confidence: the LLM's answers are not "
                       "learnable (a teacher answering at random?); the stage stays with the LLM")
        return _record(engine, pipeline, base, student, cert, sum(above), len(above))
    base.status = "active"
    base.reason = (f"{holdout} lower bound {cert.lower_bound:.3f} >= target {target:.3f} at {level:.0%} "
                   f"confidence, coverage {cert.coverage:.1%}")
    return _record(engine, pipeline, base, student, cert, sum(above), len(above))


def _near(text: str) -> str:
    """Texts with the same key are near-duplicates: the same words, whatever their case, accents'
    composition, punctuation and spacing."""
    return " ".join(re.findall(r"\w+", unicodedata.normalize("NFKC", text).casefold()))


def _llm_accuracy(engine: Engine, pipeline: str, stage: str, tenant: str, fingerprint: str,
                  golden: Sequence[tuple[str, str]], min_golden: int) -> tuple[float | None, str]:
    """The LLM's accuracy on the golden set at this fingerprint: its stored answers to the golden
    documents where enough are stored, else the latest ``etl eval`` of the fingerprint."""
    keys = {cache_key(tenant, fingerprint, content_hash(content)): label for content, label in golden}
    with engine.connect() as conn:
        found = {key: entry.output for key, entry in cache_entries(conn, list(keys)).items()}
        if len(found) >= min_golden:
            return sum(out.get("label") == keys[key] for key, out in found.items()) / len(found), ""
        latest = conn.execute(select(eval_runs.c.accuracy).where(
            eval_runs.c.pipeline == pipeline, eval_runs.c.tenant == tenant, eval_runs.c.stage == stage,
            eval_runs.c.fingerprint == fingerprint).order_by(eval_runs.c.id.desc()).limit(1)).scalar()
    if latest is not None:
        return float(latest), ""
    return None, (f"the LLM's accuracy on the golden set is unknown ({len(found)} of {len(golden)} golden documents "
                  "answered at this fingerprint): run `etl eval` first, or pass --target")


def _record(engine: Engine, pipeline: str, made: Distilled, student: Student | None, cert: Certificate | None,
            agree: int = 0, agree_n: int = 0) -> Distilled:
    """Stores the student (refused ones too: the history says why), retiring the tenant's active
    one when this one is active; one transaction."""
    spec, blob = student.dump() if student is not None else ({}, b"")
    try:
        _store_student(engine, pipeline, made, spec, blob, cert, agree, agree_n)
    except IntegrityError as exc:  # uq_students_version: another distill of the same stage and tenant won
        raise EtlError(f"another `etl distill` of {pipeline}/{made.stage} for tenant {made.tenant!r} stored a "
                       "student at the same time; run it again") from exc
    return made


def _store_student(engine: Engine, pipeline: str, made: Distilled, spec: dict[str, Any], blob: bytes,
                   cert: Certificate | None, agree: int, agree_n: int) -> None:
    from etl.quality.student import lower_bound  # noqa: PLC0415

    s = students.c
    with engine.begin() as conn:
        latest = conn.execute(select(func.max(s.version)).where(
            s.pipeline == pipeline, s.stage == made.stage, s.tenant == made.tenant)).scalar()
        made.version = (latest or 0) + 1
        if made.status == "active":
            conn.execute(update(students).where(s.pipeline == pipeline, s.stage == made.stage,
                                                s.tenant == made.tenant, s.status == "active")
                         .values(status="retired", closed_at=func.now(),
                                 reason=f"replaced by version {made.version}"))
        row = {"pipeline": pipeline, "stage": made.stage, "tenant": made.tenant, "fingerprint": made.fingerprint,
               "version": made.version, "status": made.status, "reason": made.reason,
               "trained_on": made.row.get("trained_on", 0), "holdout": made.row.get("holdout", "llm"),
               "threshold": cert.threshold if cert else None, "target": made.row.get("target", 0.0),
               "level": made.row.get("level", 0.95), "certified_on": cert.slice if cert else 0,
               "covered": cert.covered if cert else 0, "correct": cert.correct if cert else 0,
               "lower_bound": cert.lower_bound if cert else 0.0, "agreement": agree / agree_n if agree_n else 0.0,
               "agreement_lb": lower_bound(agree, agree_n, made.row.get("level", 0.95)), "agreement_n": agree_n,
               "mean_cost": made.row.get("mean_cost", 0.0), "spec": spec, "weights": blob}
        made.student_id = conn.execute(insert(students).values(**row).returning(students.c.id)).scalar_one()
    made.row.update({k: v for k, v in row.items() if k not in ("spec", "weights")})
    log.info("distilled", pipeline=pipeline, tenant=made.tenant, stage=made.stage, status=made.status,
             version=made.version, reason=made.reason)


def score_student(engine: Engine, pipeline: str, tenant: str, stage: Any, fingerprint: str,
                  items: Sequence[dict[str, Any]], llm_labels: Sequence[str | None]) -> dict[str, Any] | None:
    """The tenant's active student on golden examples, apart from the LLM and routed with it
    (the student where it is sure, the LLM elsewhere); None without an active student."""
    from etl.quality.student import Student  # noqa: PLC0415

    s = students.c
    with engine.connect() as conn:
        row = conn.execute(select(s.id, s.threshold, s.spec, s.weights).where(
            s.pipeline == pipeline, s.tenant == tenant, s.stage == stage.name, s.fingerprint == fingerprint,
            s.status == "active")).first()
    if row is None or not items:
        return None
    labels, confidence = Student.load(row.spec, bytes(row.weights)).predict([e["content"] for e in items])
    gold = [e["expected"].get("label") for e in items]
    sure = [c >= row.threshold for c in confidence]
    covered = sum(sure)
    routed = [mine if ok else theirs for mine, ok, theirs in zip(labels, sure, llm_labels, strict=True)]
    return {"student": f"student:{row.id}", "coverage": covered / len(items),
            "accuracy": sum(a == g for a, g in zip(labels, gold, strict=True)) / len(items),
            "accuracy_when_sure": (sum(a == g for a, g, ok in zip(labels, gold, sure, strict=True) if ok) / covered
                                   if covered else None),
            "routed_accuracy": sum(a == g for a, g in zip(routed, gold, strict=True)) / len(items)}


# -- run time -----------------------------------------------------------------------------------

@dataclass
class Live:
    """An active student as a running worker holds it."""

    id: int
    tenant: str
    stage: str
    fingerprint: str
    threshold: float
    agreement_lb: float
    mean_cost: float
    model: Student
    router: Router
    recent: collections.deque[bool]
    off: bool = False

    @property
    def answered_by(self) -> str:
        return f"student:{self.id}"

    def answer(self, stage: Any, text: str) -> tuple[BaseModel, str] | None:
        """(output, label) when the student is sure and its answer passes the stage's checks
        (pydantic and semantic validators, as every answer must), else None."""
        label, confidence = self.model.predict_one(text)
        if confidence < self.threshold:
            return None
        try:
            output = stage.output_model.model_validate({"label": label, "confidence": min(1.0, confidence)})
        except ValueError:
            return None
        if any(validator(output) is not None for validator in stage.validators):
            return None
        return output, label

    def verdict(self) -> tuple[float, int, int] | None:
        """(p-value, agreeing, checks) when the recent checks say the student no longer agrees as
        certified, else None. Two spans are judged, each at half of ``alpha``: the last
        ``min_checks`` (a sudden change shows within a few dozen checks) and the whole window (a
        slow one)."""
        from scipy.stats import binom  # noqa: PLC0415

        n = len(self.recent)
        if n < self.router.min_checks:
            return None
        for span in sorted({self.router.min_checks, n}):
            k = sum(itertools.islice(reversed(self.recent), span))
            p = float(binom.cdf(k, span, self.agreement_lb))
            if p < self.router.alpha / 2:
                return p, k, span
        return None


class Students:
    """The active students of one pipeline's routed stages, by (tenant, stage, fingerprint).

    Loaded from the store at start and every ``refresh_s``; switch-offs decided here are written
    by :meth:`flush` (the runner calls both on its store thread)."""

    def __init__(self, engine: Engine, pipeline: str, routers: dict[str, Router]) -> None:
        self.engine = engine
        self.pipeline = pipeline
        self.routers = routers
        self.live: dict[tuple[str, str, str], Live] = {}
        self.pending: list[tuple[Live, float, int, int]] = []
        self.loaded_at = 0.0

    def due(self) -> bool:
        return time.monotonic() - self.loaded_at > min(r.refresh_s for r in self.routers.values())

    def load(self) -> None:
        from etl.quality.student import Student  # noqa: PLC0415

        s = students.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(s.id, s.tenant, s.stage, s.fingerprint, s.threshold, s.agreement_lb,
                                       s.mean_cost).where(s.pipeline == self.pipeline, s.status == "active",
                                                          s.stage.in_(sorted(self.routers)))).all()
            known = {live.id: live for live in self.live.values()}
            fresh: dict[tuple[str, str, str], Live] = {}
            for sid, tenant, stage, fingerprint, threshold, agreement_lb, mean_cost in rows:
                live = known.get(sid)
                if live is None:
                    spec, blob = conn.execute(select(s.spec, s.weights).where(s.id == sid)).one()
                    try:
                        if not all(isinstance(v, int | float) and math.isfinite(v)
                                   for v in (threshold, agreement_lb, mean_cost)):
                            raise ValueError("an active student needs a finite threshold, agreement bound and cost")
                        model = Student.load(spec, bytes(blob))
                    except Exception as exc:  # a row anyone could have edited: never stops a run
                        log.warning("student_unreadable", student=sid, error=f"{type(exc).__name__}: {exc}")
                        continue
                    router = self.routers[stage]
                    recent = conn.execute(select(router_checks.c.agree).where(router_checks.c.tenant == tenant,
                                                                      router_checks.c.student_id == sid)
                                          .order_by(router_checks.c.id.desc()).limit(router.window)).scalars()
                    live = Live(sid, tenant, stage, fingerprint, threshold, agreement_lb, mean_cost, model, router,
                                collections.deque(reversed(list(recent)), maxlen=router.window))
                if not live.off:
                    fresh[(tenant, stage, fingerprint)] = live
        self.live = fresh
        self.loaded_at = time.monotonic()

    def active(self, tenant: str, stage: str, fingerprint: str) -> Live | None:
        live = self.live.get((tenant, stage, fingerprint))
        return None if live is None or live.off else live

    def observe(self, live: Live, agree: bool) -> None:
        """One shadow check; a student whose checks no longer hold is switched off at once."""
        live.recent.append(agree)
        if not live.off and (verdict := live.verdict()) is not None:
            live.off = True
            self.pending.append((live, *verdict))
            log.warning("student_switched_off", pipeline=self.pipeline, tenant=live.tenant, stage=live.stage,
                        student=live.id, agreement=round(verdict[1] / verdict[2], 4), p_value=verdict[0])

    def flush(self, pending: list[tuple[Live, float, int, int]]) -> int:
        """Writes switch-offs taken from ``pending`` (each once, with its alert)."""
        with self.engine.begin() as conn:
            for live, p, k, n in pending:
                reason = (f"shadow agreement {k}/{n} = {k / n:.3f} over the last {n} checks is below the certified "
                          f"{live.agreement_lb:.3f} (p = {p:.2g} < {live.router.alpha / 2:g})")
                hit = conn.execute(update(students).where(students.c.id == live.id, students.c.status == "active")
                                   .values(status="off", reason=reason, closed_at=func.now())).rowcount
                if hit:
                    conn.execute(insert(drift_alerts).values(
                        pipeline=self.pipeline, tenant=live.tenant, stage=live.stage, metric="router_agreement",
                        baseline=live.agreement_lb, recent=k / n, score=-math.log10(max(p, 1e-300)),
                        threshold=-math.log10(live.router.alpha / 2), window=n))  # as every alert: score > threshold
        return len(pending)
