"""Human review: verdicts read back from an exported file, matched to the queue by item id.

The file is a reviewer's copy and may have been edited anywhere: only ``verdict``, ``corrected``
and ``reviewer`` are taken from it. Tenant, pipeline, stage, key, text and the model's output come
from the stored item, and a line that changed any of them is rejected, so an edited file can never
put one tenant's text or answer under another tenant (in the queue or, promoted, in the golden set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, select, update

from connectors.store.tables import review_queue as q
from connectors.store.write import chunks
from etl.errors import ConfigError
from etl.quality.golden import store_golden
from etl.storable import INT64, text_problem, value_problem

#: What a reviewer fills in; everything else in a line must be as exported.
EDITABLE = ("verdict", "corrected", "reviewer")
#: Exported fields checked against the stored item.
EXPORTED = ("pipeline", "tenant", "stage", "doc_key", "content", "output", "sampled_because")


@dataclass(frozen=True)
class Verdict:
    item: dict[str, Any]  # the stored review item
    verdict: str
    corrected: dict[str, Any] | None
    reviewer: str | None


def read_verdicts(engine: Engine, path: Path) -> list[Verdict]:
    """The file's verdicts, each checked against its stored item; any reject fails the whole file
    (naming each rejected line), so nothing is half imported. Lines without a verdict are skipped."""
    lines: list[tuple[int, dict[str, Any]]] = []
    rejects: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="surrogateescape").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:  # not JSON, or an integer too long to read
            rejects.append(f"line {number}: not JSON ({getattr(exc, 'msg', exc)})")
            continue
        if (not isinstance(row, dict) or isinstance(row.get("id"), bool) or not isinstance(row.get("id"), int)
                or not INT64[0] <= row["id"] <= INT64[1]):
            rejects.append(f"line {number}: needs the review item's id, as exported")
        elif row.get("verdict") is not None:
            lines.append((number, row))
    ids = sorted({row["id"] for _, row in lines})
    stored: dict[int, dict[str, Any]] = {}
    with engine.connect() as conn:
        for chunk in chunks(ids):
            stored.update({r["id"]: dict(r) for r in conn.execute(select(q).where(q.c.id.in_(chunk))).mappings()})
    verdicts: list[Verdict] = []
    seen: dict[int, int] = {}
    for number, row in lines:
        item = stored.get(row["id"])
        try:
            if row["id"] in seen:
                raise ValueError(f"item {row['id']} is also on line {seen[row['id']]}")
            if item is None:
                raise ValueError(f"no review item {row['id']} in this store")
            verdicts.append(_verdict(row, _decoded(item)))
            seen[row["id"]] = number
        except ValueError as exc:
            rejects.append(f"line {number}: {exc}")
    if rejects:
        shown = "; ".join(rejects[:10]) + (f"; and {len(rejects) - 10} more" if len(rejects) > 10 else "")
        raise ConfigError(f"{path}: {len(rejects)} line(s) rejected, nothing imported: {shown}")
    return verdicts


def _decoded(item: dict[str, Any]) -> dict[str, Any]:
    output = item["output"]
    return {**item, "output": json.loads(output) if isinstance(output, str) else output}


def _verdict(row: dict[str, Any], item: dict[str, Any]) -> Verdict:
    if item["status"] not in ("exported", "reviewed"):
        raise ValueError(f"review item {item['id']} was never exported (`etl review export`)")
    # Every exported field, as exported: a line cannot point at another item by its id alone.
    for field in EXPORTED:
        if field not in row:
            raise ValueError(f"{field} is missing; keep every exported field as it was")
        if row[field] != item[field]:
            raise ValueError(f"{field} differs from stored item {item['id']}'s; only {', '.join(EDITABLE)} may be edited")
    verdict, corrected, reviewer = row["verdict"], row.get("corrected"), row.get("reviewer")
    if verdict not in ("correct", "incorrect"):
        raise ValueError(f"verdict must be 'correct' or 'incorrect', not {verdict!r}")
    if verdict == "correct":
        corrected = None
    else:
        if not isinstance(corrected, dict) or not corrected:
            raise ValueError("an incorrect verdict needs a corrected answer (a JSON object)")
        fields = set(item["output"]) - {"confidence"}
        if set(corrected) - {"confidence"} != fields:
            raise ValueError(f"corrected must have the output's fields {sorted(fields)}, not {sorted(corrected)}")
        if (problem := value_problem(corrected, "corrected")) is not None:
            raise ValueError(problem)
    if reviewer is not None and (not isinstance(reviewer, str) or len(reviewer) > 200 or text_problem(reviewer)):
        raise ValueError("reviewer must be a name of at most 200 characters")
    return Verdict(item, verdict, corrected, reviewer)


def record_verdicts(engine: Engine, verdicts: list[Verdict], reviewer: str | None, *, promote: bool) -> tuple[int, int]:
    """Records the verdicts (again: the same values); with ``promote``, confirmed or corrected
    answers of items whose text was kept join the golden set. Returns (recorded, promoted)."""
    if reviewer is not None and (len(reviewer) > 200 or text_problem(reviewer)):
        raise ConfigError("--reviewer must be a name of at most 200 characters")
    named = [replace(v, reviewer=reviewer or v.reviewer) for v in verdicts]
    with engine.begin() as conn:  # one transaction: all recorded and promoted, or nothing
        promoted = record(conn, named, datetime.now(timezone.utc), promote=promote)
    return len(verdicts), promoted


def record(conn: Connection, verdicts: list[Verdict], now: datetime, *, promote: bool) -> int:
    """The verdicts, each in its ``reviewer``'s name, in the caller's transaction, and (``promote``,
    text kept) their golden examples, written with who and when; the same verdicts again write
    nothing new. Returns how many examples were promoted. Raises ItemChanged when an item is not
    the one read (purged, replaced, or, on PostgreSQL, not the writer's to review: its policies let
    the update touch no row)."""
    by_target: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for v in verdicts:
        item = v.item
        changed = conn.execute(update(q).where(
            q.c.id == item["id"], q.c.pipeline == item["pipeline"], q.c.tenant == item["tenant"],
            q.c.stage == item["stage"], q.c.doc_key == item["doc_key"]).values(
            status="reviewed", verdict=v.verdict, corrected=v.corrected, reviewer=v.reviewer,
            reviewed_at=now)).rowcount
        if changed != 1:
            raise ItemChanged(f"review item {item['id']} changed while recording; nothing recorded, run it again")
        if promote and item["content"]:  # no text kept (store_text=False): nothing to evaluate on
            expected = v.corrected if v.verdict == "incorrect" else item["output"]
            by_target.setdefault((item["pipeline"], item["stage"]), []).append({
                "tenant": item["tenant"], "doc_key": item["doc_key"], "content": item["content"],
                "expected": {k: value for k, value in (expected or {}).items() if k != "confidence"},
                "reviewer": v.reviewer, "reviewed_at": now})
    for (pipeline, stage), examples in by_target.items():  # one upsert per target, rows in key order
        store_golden(conn, pipeline, stage, examples, origin="review")
    return sum(len(e) for e in by_target.values())


class ItemChanged(ConfigError):
    """A review item is no longer the one that was read, or not the writer's to review."""
