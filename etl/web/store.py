"""What the review pages read, through the reviewer's own connection.

On PostgreSQL every query runs as the login that signed in, so row-level security decides which
tenants' rows exist for it: an item of a tenant not granted to the login is simply not there (the
page answers 403 for it, the same as for an id that does not exist, so nothing leaks). Nothing here
filters by tenant for security; the filters are the reviewer's own narrowing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, and_, case, func, select

from connectors.store.tables import drift_alerts, eval_runs, field_spans, golden_examples, review_queue, stage_results

q = review_queue.c
#: The queue's status filter: open items are those not yet reviewed.
STATUSES = {"open": ("pending", "exported"), "reviewed": ("reviewed",), "all": ("pending", "exported", "reviewed")}
QUEUE_LIMIT = 500


@dataclass(frozen=True)
class Filters:
    tenant: str = ""
    stage: str = ""
    reason: str = ""
    status: str = "open"

    @classmethod
    def of(cls, params: Any) -> Filters:
        """From a query string; a value no stored row can hold (a NUL) filters nothing."""
        def value(name: str, limit: int) -> str:
            given = str(params.get(name, ""))[:limit]
            return "" if "\x00" in given else given

        status = params.get("status", "open")
        return cls(value("tenant", 200), value("stage", 200), value("reason", 20), status if status in STATUSES else "open")

    def query(self) -> str:
        from urllib.parse import urlencode  # noqa: PLC0415

        return urlencode({k: v for k, v in vars(self).items() if v and not (k == "status" and v == "open")})

    def where(self, pipeline: str) -> Any:
        conditions = [q.pipeline == pipeline, q.status.in_(STATUSES[self.status])]
        conditions += [column == value for column, value in ((q.tenant, self.tenant), (q.stage, self.stage),
                                                               (q.sampled_because, self.reason)) if value]
        return and_(*conditions)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def queue(engine: Engine, pipeline: str, filters: Filters) -> tuple[list[dict[str, Any]], dict[str, list[str]], int]:
    """The filtered items (first ``QUEUE_LIMIT``), the choices for each filter, and how many match."""
    with engine.connect() as conn:
        items = [dict(r) for r in conn.execute(
            select(q.id, q.tenant, q.stage, q.doc_key, q.sampled_because, q.status, q.output, q.verdict, q.reviewer,
                   q.created_at).where(filters.where(pipeline)).order_by(q.id).limit(QUEUE_LIMIT)).mappings()]
        total = conn.execute(select(func.count()).select_from(review_queue).where(filters.where(pipeline))).scalar_one()
        choices = {name: sorted(conn.execute(select(column).where(q.pipeline == pipeline).distinct()).scalars())
                   for name, column in (("tenant", q.tenant), ("stage", q.stage), ("reason", q.sampled_because))}
    for item in items:
        item["output"] = _json(item["output"])
    return items, choices, int(total)


def item(engine: Engine, pipeline: str, item_id: int) -> dict[str, Any] | None:
    """One review item with what the page shows beside it (spans, the stored result's model and
    fingerprint), or None when it is not there for this login."""
    with engine.connect() as conn:
        row = conn.execute(select(review_queue).where(q.id == item_id, q.pipeline == pipeline)).mappings().first()
        if row is None:
            return None
        found = dict(row)
        key = (field_spans.c.pipeline == pipeline, field_spans.c.tenant == found["tenant"],
               field_spans.c.doc_key == found["doc_key"], field_spans.c.stage == found["stage"])
        found["spans"] = [dict(r) for r in conn.execute(select(field_spans).where(*key).order_by(
            field_spans.c.char_start, field_spans.c.path)).mappings()]
        r = stage_results.c
        found["result"] = conn.execute(select(r.model, r.fingerprint, r.output, r.created_at).where(
            r.pipeline == pipeline, r.tenant == found["tenant"], r.doc_key == found["doc_key"],
            r.stage == found["stage"]).order_by(r.id.desc()).limit(1)).mappings().first()
        g = golden_examples.c
        found["golden"] = conn.execute(select(g.expected, g.origin, g.reviewer, g.reviewed_at).where(
            g.pipeline == pipeline, g.tenant == found["tenant"], g.stage == found["stage"],
            g.doc_key == found["doc_key"])).mappings().first()
    found["output"] = _json(found["output"])
    found["corrected"] = _json(found["corrected"])
    return found


def neighbour(engine: Engine, pipeline: str, filters: Filters, after: int) -> int | None:
    """The next item of the filtered queue after ``after`` (then the first, once it wraps)."""
    with engine.connect() as conn:
        later = conn.execute(select(func.min(q.id)).where(filters.where(pipeline), q.id > after)).scalar()
        if later is None:
            later = conn.execute(select(func.min(q.id)).where(filters.where(pipeline), q.id != after)).scalar()
    return None if later is None else int(later)


def quality(engine: Engine, pipeline: str) -> dict[str, list[dict[str, Any]]]:
    """Per tenant: the latest eval per stage and model, drift alerts, grounded share, review counts."""
    e, d, s, g = eval_runs.c, drift_alerts.c, field_spans.c, golden_examples.c
    latest = select(func.max(e.id)).where(e.pipeline == pipeline).group_by(e.tenant, e.stage, e.model)
    with engine.connect() as conn:
        evals = [dict(r) for r in conn.execute(select(
            e.tenant, e.stage, e.model, e.examples, e.failed, e.accuracy, e.macro_f1, e.created_at).where(
            e.id.in_(latest)).order_by(e.tenant, e.stage, e.model)).mappings()]
        drifts = [dict(r) for r in conn.execute(select(
            d.tenant, d.stage, d.metric, d.baseline, d.recent, d.score, d.created_at).where(
            d.pipeline == pipeline).order_by(d.id.desc()).limit(50)).mappings()]
        grounded = [dict(r) for r in conn.execute(select(
            s.tenant, s.stage, func.count().label("values"),
            func.sum(case((s.match != "none", 1), else_=0)).label("grounded")).where(
            s.pipeline == pipeline).group_by(s.tenant, s.stage).order_by(s.tenant, s.stage)).mappings()]
        golden = [dict(r) for r in conn.execute(select(
            g.tenant, g.stage, func.count().label("examples"),
            func.sum(case((g.origin == "review", 1), else_=0)).label("from_review")).where(
            g.pipeline == pipeline).group_by(g.tenant, g.stage).order_by(g.tenant, g.stage)).mappings()]
        reviews = [dict(r) for r in conn.execute(select(
            q.tenant, q.stage, q.status, func.count().label("items")).where(q.pipeline == pipeline).group_by(
            q.tenant, q.stage, q.status).order_by(q.tenant, q.stage, q.status)).mappings()]
    for row in grounded:
        row["share"] = (row["grounded"] or 0) / row["values"] if row["values"] else None
    return {"evals": evals, "drifts": drifts, "grounded": grounded, "golden": golden, "reviews": reviews}


def segments(text: str, spans: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The text cut at every span's edge: (piece, the spans covering it), for highlighting. Spans
    outside the text (a document that changed since) are left out, never drawn elsewhere."""
    inside = [s for s in spans if s["char_start"] is not None and s["char_end"] is not None
              and 0 <= s["char_start"] < s["char_end"] <= len(text)]
    edges = sorted({0, len(text), *(s["char_start"] for s in inside), *(s["char_end"] for s in inside)})
    out = []
    for start, end in zip(edges, edges[1:]):
        covering = [s for s in inside if s["char_start"] <= start and s["char_end"] >= end]
        out.append((text[start:end], covering))
    return out
