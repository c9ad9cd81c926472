"""The quality report: one self-contained HTML page of eval accuracy, drift, grounding and
calibration, and spend per tenant.

Self-contained (inline CSS, hand-drawn SVG, no JavaScript, no assets) so the page can be attached to
a CI run, mailed, or opened from a bucket with no server, and so drawing it needs no new dependency.
Every string that comes from the store is escaped: tenant and stage names are user input.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, case, func, inspect, select, text

from connectors.store.tables import drift_alerts, eval_runs, field_spans, stability_runs, stage_results

#: Okabe-Ito minus yellow: tells tenants apart under the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#7F7F7F")
DASHES = ("", "7 4", "2 3", "9 3 2 3")  # one per model when a stage ran on several
ALERT, CALM, SPENT, SAVED, GRID = "#C62828", "#7B93B8", "#5B6C8F", "#2E9E6B", "#E4E7EB"
W = 760  # every chart's viewBox width; the CSS scales it to the page

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2933;background:#f3f5f8;margin:0}
main{max-width:1000px;margin:0 auto;padding:28px 24px}
h1{margin:0;font-size:26px}header p{margin:4px 0 0;color:#52606d}
.cards{display:flex;gap:12px;margin:20px 0 0}
.card{flex:1;background:#fff;border-radius:10px;padding:12px 16px;box-shadow:0 1px 3px #0002}
.card b{display:block;font-size:22px}.card span{color:#52606d;font-size:12px;text-transform:uppercase}
section{background:#fff;border-radius:10px;padding:18px 22px;margin:20px 0;box-shadow:0 1px 3px #0002;overflow-x:auto}
h2{margin:0 0 2px;font-size:19px}h3{font-size:15px;margin:18px 0 2px;color:#323f4b}
.sub{color:#52606d;margin:0 0 8px}
.empty{color:#52606d;background:#f0f4f8;border-radius:8px;padding:12px 16px;margin:8px 0 0}
code{background:#e4e7eb;border-radius:4px;padding:1px 5px}
svg{display:block;width:100%;height:auto}svg text{font:11px system-ui,sans-serif;fill:#52606d}
.legend{display:flex;flex-wrap:wrap;gap:4px 18px;font-size:12.5px;color:#323f4b;margin:4px 0 6px}
.legend i{display:inline-block;width:16px;height:10px;border-radius:2px;margin-right:6px;vertical-align:-1px}
table{border-collapse:collapse;width:100%;font-size:13px;margin-top:10px}
th{text-align:left;color:#52606d;font-weight:600;border-bottom:2px solid #e4e7eb;padding:6px;white-space:nowrap}
td{border-bottom:1px solid #eef1f4;padding:5px 6px;white-space:nowrap}
.n{text-align:right;font-variant-numeric:tabular-nums}
.bad{color:#c62828;font-weight:600}.up{color:#2e7d32}.down{color:#c62828}
"""

Row = dict[str, Any]


def _e(value: object) -> str:
    return html.escape(str(value))


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _usd(value: float) -> str:
    """Dollars; amounts under ten cents keep four decimals, since one call often costs a fraction of a cent."""
    return f"${value:,.2f}" if value == 0 or abs(value) >= 0.1 else f"${value:.4f}"


def _utc(value: Any) -> dt.datetime:
    """SQLite hands back naive UTC (or a string through a view); PostgreSQL an aware timestamp."""
    when = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
    return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)


def _when(value: dt.datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int) -> str:
    """Cells are already HTML; columns from ``numeric_from`` on are right-aligned numbers."""
    def cls(i: int) -> str:
        return ' class="n"' if i >= numeric_from else ""
    ths = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(head))
    trs = "".join("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{ths}</tr></thead><tbody>{trs}</tbody></table>"


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{c}"></i>{_e(label)}</span>' for label, c in items) + "</div>"


def _empty(command: str) -> str:
    return f'<p class="empty">No data yet — run <code>{command}</code> to fill this section.</p>'


def _ticks(top: float) -> tuple[float, list[float]]:
    """A round axis maximum at or above ``top`` and its 4-6 evenly spaced ticks, so gridlines read as round numbers."""
    top = top if top > 0 else 1.0
    step = 10 ** math.floor(math.log10(top / 4))
    step = next(step * m for m in (1, 2, 2.5, 5, 10) if top / (step * m) <= 5)
    n = math.ceil(top / step - 1e-9)
    return n * step, [i * step for i in range(n + 1)]


def _accuracy_chart(series: Sequence[tuple[str, str, str, list[Row]]]) -> str:
    """Accuracy (0-100%) against eval time: one line per (label, colour, dash, runs), a tooltip per run."""
    h, left, right, top, bottom = 250, 62, 24, 12, 44
    times = [r["at"].timestamp() for *_, runs in series for r in runs]
    lo, hi = min(times), max(times)
    if hi - lo < 60:  # one run, or runs at one instant: centre them on a one-day axis
        lo, hi = lo - 43200, hi + 43200
    def x(t: float) -> float:
        return left + (t - lo) / (hi - lo) * (W - left - right)
    def y(v: float) -> float:
        return top + (1 - v) * (h - top - bottom)
    out = [f'<svg viewBox="0 0 {W} {h}" role="img" aria-label="accuracy over time">']
    for p in (0, 25, 50, 75, 100):
        out.append(f'<line x1="{left}" x2="{W - right}" y1="{y(p / 100):.1f}" y2="{y(p / 100):.1f}" stroke="{GRID}"/>'
                   f'<text x="{left - 8}" y="{y(p / 100) + 4:.1f}" text-anchor="end">{p}%</text>')
    fmt = "%b %d" if hi - lo >= 3 * 86400 else "%b %d %H:%M"
    for i in range(5):
        t = lo + i * (hi - lo) / 4
        anchor = ("start", "middle", "middle", "middle", "end")[i]
        label = dt.datetime.fromtimestamp(t, dt.UTC).strftime(fmt)
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{h - bottom}" y2="{h - bottom + 5}" stroke="#9aa5b1"/>'
                   f'<text x="{x(t):.1f}" y="{h - bottom + 18}" text-anchor="{anchor}">{label}</text>')
    out.append(f'<text x="{(left + W - right) / 2}" y="{h - 4}" text-anchor="middle">eval run (UTC)</text>'
               f'<text transform="translate(14 {(top + h - bottom) / 2}) rotate(-90)" text-anchor="middle">'
               "accuracy</text>")
    for label, colour, dash, runs in series:
        pts = [(x(r["at"].timestamp()), y(r["accuracy"])) for r in runs]
        if len(pts) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2.5"'
                       f' stroke-dasharray="{dash}" stroke-linejoin="round"/>')
        for (px, py), r in zip(pts, runs, strict=True):
            f1 = "–" if r["macro_f1"] is None else f"{r['macro_f1']:.3f}"
            tip = (f"{label} · {_when(r['at'])} UTC\naccuracy {_pct(r['accuracy'])} · macro-F1 {f1}\n"
                   f"{r['examples']} examples · fingerprint {r['fingerprint'][:8]}")
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{colour}" stroke="#fff" stroke-width="1.5">'
                       f"<title>{_e(tip)}</title></circle>")
    return "".join(out) + "</svg>"


def _bar_chart(rows: Sequence[tuple[str, list[tuple[float, str]], float | None, str]], scale_max: float,
               axis: Callable[[float], str], axis_label: str) -> str:
    """Horizontal bars: per row (label, stacked (value, colour) segments, threshold marker or None, right note)."""
    fits = 52  # characters of label that fit the widest left margin; longer ones are cut, whole in the tooltip
    left, right, top, band = round(min(max(len(r[0]) for r in rows), fits) * 6.3) + 24, 100, 8, 30
    h = top + band * len(rows) + 40
    axis_max, ticks = _ticks(scale_max * 1.04)  # headroom: a marker at the top stays off the edge
    def x(v: float) -> float:
        return left + v / axis_max * (W - left - right)
    out = [f'<svg viewBox="0 0 {W} {h}" role="img" aria-label="{_e(axis_label)}">']
    base = top + band * len(rows)
    for t in ticks:
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{base}" stroke="{GRID}"/>'
                   f'<text x="{x(t):.1f}" y="{base + 16}" text-anchor="middle">{axis(t)}</text>')
    out.append(f'<text x="{(left + W - right) / 2}" y="{h - 4}" text-anchor="middle">{_e(axis_label)}</text>')
    for i, (label, segments, marker, note) in enumerate(rows):
        yy = top + i * band + 6
        short = label if len(label) <= fits else label[:fits - 1] + "…"
        out.append(f'<text x="{left - 10}" y="{yy + 13}" text-anchor="end">'
                   f"<title>{_e(label)}</title>{_e(short)}</text>")
        start = 0.0
        for value, colour in segments:
            width = max(x(start + value) - x(start), 2.0 if value > 0 else 0.0)  # a sliver, not nothing
            out.append(f'<rect x="{x(start):.1f}" y="{yy}" width="{width:.1f}" height="18" rx="2" fill="{colour}"/>')
            start += value
        if marker is not None:
            out.append(f'<line x1="{x(marker):.1f}" x2="{x(marker):.1f}" y1="{yy - 4}" y2="{yy + 22}"'
                       ' stroke="#1f2933" stroke-width="2.5"/>')
        out.append(f'<text x="{W - right + 10}" y="{yy + 13}" style="fill:#1f2933">{_e(note)}</text>')
    return "".join(out) + "</svg>"


def _reliability(runs: Sequence[tuple[str, str, dict[str, Any]]]) -> str:
    """A reliability diagram: per run (label, colour, calibration), each bin's accuracy against
    its mean confidence (dot area by count), the diagonal being perfect calibration."""
    size, pad = 300, 40
    def at(v: float) -> float:
        return pad + v * (size - 2 * pad)
    out = [f'<svg viewBox="0 0 {size} {size}" style="max-width:{size}px" role="img" '
           'aria-label="reliability diagram: accuracy against confidence">',
           f'<line x1="{at(0)}" y1="{size - at(0)}" x2="{at(1)}" y2="{size - at(1)}" stroke="#9aa5b1" '
           'stroke-dasharray="4 3"/>']
    for t in (0.0, 0.5, 1.0):
        out.append(f'<text x="{at(t)}" y="{size - pad + 16}" text-anchor="middle">{t:g}</text>'
                   f'<text x="{pad - 8}" y="{size - at(t) + 4}" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="{size / 2}" y="{size - 4}" text-anchor="middle">confidence</text>'
               f'<text x="12" y="{size / 2}" transform="rotate(-90 12 {size / 2})" text-anchor="middle">accuracy</text>')
    for label, colour, cal in runs:
        total = max(1, cal.get("pairs") or 1)
        for b in cal.get("bins", []):
            if not b.get("count"):
                continue
            r = 3 + 9 * math.sqrt(b["count"] / total)
            out.append(f'<circle cx="{at(b["confidence"]):.1f}" cy="{size - at(b["accuracy"]):.1f}" r="{r:.1f}" '
                       f'fill="{colour}" fill-opacity="0.75"><title>{_e(label)}: {b["count"]} values, confidence '
                       f'{b["confidence"]:.2f}, accuracy {b["accuracy"]:.2f}</title></circle>')
    return "".join(out) + "</svg>"


def _fetch(engine: Engine, pipeline: str | None) -> tuple[list[Row], list[Row], list[Row]]:
    """(eval runs oldest first, drift alerts newest first, spend per pipeline × tenant); empty when never migrated."""
    found = inspect(engine)
    names = set(found.get_table_names()) | set(found.get_view_names())
    evals: list[Row] = []
    drifts: list[Row] = []
    costs: list[Row] = []
    with engine.connect() as conn:
        if "eval_runs" in names:
            q = select(eval_runs).order_by(eval_runs.c.created_at, eval_runs.c.id)
            evals = [dict(r) for r in conn.execute(q.where(eval_runs.c.pipeline == pipeline) if pipeline else q)
                     .mappings()]
        if "drift_alerts" in names:
            q = select(drift_alerts).order_by(drift_alerts.c.created_at.desc(), drift_alerts.c.id.desc())
            drifts = [dict(r) for r in conn.execute(q.where(drift_alerts.c.pipeline == pipeline) if pipeline else q)
                      .mappings()]
        if "quality_daily" in names:
            costs = [dict(r) for r in conn.execute(text(
                "SELECT pipeline, tenant, sum(stage_runs) AS stage_runs, sum(llm_calls) AS llm_calls,"
                " sum(cache_hits) AS cache_hits, sum(coalesce(failure_rate, 0) * stage_runs) AS failed,"
                " sum(tokens) AS tokens, sum(cost) AS cost, sum(saved) AS saved, min(day) AS first, max(day) AS last"
                " FROM quality_daily" + (" WHERE pipeline = :pipeline" if pipeline else "") +
                " GROUP BY pipeline, tenant ORDER BY pipeline, tenant"), {"pipeline": pipeline}).mappings()]
    for r in evals + drifts:
        r["at"] = _utc(r["created_at"])
    for r in costs:  # PostgreSQL sums come back as Decimal
        r.update({k: float(r[k] or 0) for k in ("stage_runs", "llm_calls", "cache_hits", "failed", "tokens", "cost",
                                                 "saved")})
    return evals, drifts, costs


def _grounding(engine: Engine, pipeline: str | None) -> list[Row]:
    """Per pipeline × tenant × stage: values, grounded values, values with a confidence, their mean."""
    if "field_spans" not in inspect(engine).get_table_names():
        return []
    c = field_spans.c
    query = select(c.pipeline, c.tenant, c.stage, func.count().label("values"),
                   func.sum(case((c.match != "none", 1), else_=0)).label("grounded"),
                   func.count(c.confidence).label("confident"), func.avg(c.confidence).label("mean_confidence")
                   ).group_by(c.pipeline, c.tenant, c.stage).order_by(c.pipeline, c.tenant, c.stage)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(query.where(c.pipeline == pipeline) if pipeline else query).mappings()]
    for r in rows:
        r.update({k: float(r[k] or 0) for k in ("values", "grounded", "confident")})
        r["mean_confidence"] = None if r["mean_confidence"] is None else float(r["mean_confidence"])
    return rows


def _answered(engine: Engine, pipeline: str | None) -> list[Row]:
    """Stored results per pipeline × tenant × stage × the model that answered (a budget's fallback
    model, a router's student and the main model apart)."""
    if "stage_results" not in inspect(engine).get_table_names():
        return []
    c = stage_results.c
    query = select(c.pipeline, c.tenant, c.stage, c.model, func.count().label("results")).group_by(
        c.pipeline, c.tenant, c.stage, c.model).order_by(c.pipeline, c.tenant, c.stage, func.count().desc(), c.model)
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(query.where(c.pipeline == pipeline) if pipeline else query).mappings()]


def _stability(engine: Engine, pipeline: str | None) -> list[Row]:
    """Every ``etl stability`` run, oldest first."""
    if "stability_runs" not in inspect(engine).get_table_names():
        return []
    q = select(stability_runs).order_by(stability_runs.c.created_at, stability_runs.c.id)
    with engine.connect() as conn:
        found = [dict(r) for r in conn.execute(q.where(stability_runs.c.pipeline == pipeline) if pipeline else q)
                 .mappings()]
    for r in found:
        r["at"] = _utc(r["created_at"])
    return found


def write_report(engine: Engine, out_dir: Path, pipeline: str | None = None) -> Path:
    """Writes out_dir/index.html (creating out_dir) and returns its path.

    One page, five sections (eval accuracy over time, drift, grounding and calibration, stability,
    spend and cache savings per tenant),
    each saying which command fills it while its table is empty. ``pipeline`` narrows every query.
    """
    evals, drifts, costs = _fetch(engine, pipeline)
    grounded = _grounding(engine, pipeline)
    stable = _stability(engine, pipeline)
    answered = _answered(engine, pipeline)
    multi = len({r["pipeline"] for r in evals + drifts + costs + grounded + stable + answered}) > 1
    def who(r: Row) -> str:  # tenants are only unique within a pipeline
        return f"{r['pipeline']}/{r['tenant']}" if multi else str(r["tenant"])
    colours: dict[str, str] = {}
    for name in sorted({who(r) for r in evals + drifts + costs + grounded + stable}):
        colours[name] = PALETTE[len(colours) % len(PALETTE)]

    # -- accuracy over time
    acc = ['<section id="accuracy"><h2>Accuracy over time</h2>'
           '<p class="sub">Golden-set accuracy of each eval run; hover a point for macro-F1, size and fingerprint.</p>']
    stages = sorted({(r["pipeline"], r["stage"]) for r in evals})
    for p, stage in stages:
        runs = [r for r in evals if (r["pipeline"], r["stage"]) == (p, stage)]
        models = sorted({r["model"] for r in runs})
        keys = sorted({(who(r), r["model"] if len(models) > 1 else "") for r in runs})
        series = [(f"{t} · {m}" if m else t, colours[t], DASHES[models.index(m) % len(DASHES)] if m else "",
                   [r for r in runs if who(r) == t and (not m or r["model"] == m)]) for t, m in keys]
        acc.append(f"<h3>{_e(f'{p} · {stage}' if multi else stage)}</h3>"
                   + _legend([(label, c) for label, c, _, _ in series]) + _accuracy_chart(series))
    latest: dict[tuple[str, str, str, str], list[Row]] = {}
    for r in evals:
        latest.setdefault((who(r), r["pipeline"], r["stage"], r["model"]), []).append(r)
    rows = []
    for (t, _, stage, model), runs in sorted(latest.items()):
        last, change = runs[-1], ""
        if len(runs) > 1:
            d = (last["accuracy"] - runs[-2]["accuracy"]) * 100
            change = (f'<span class="{"up" if d > 0 else "down"}">{"▲" if d > 0 else "▼"} {abs(d):.1f} pts</span>'
                      if round(d, 1) else "= 0.0 pts")
        f1 = "–" if last["macro_f1"] is None else f"{last['macro_f1']:.3f}"
        rows.append([_e(t), _e(stage), _e(model), f"<b>{_pct(last['accuracy'])}</b>", change, f1,
                     str(last["examples"]), _when(last["at"])])
    acc.append(_table(["Tenant", "Stage", "Model", "Accuracy", "Change", "Macro-F1", "Examples", "When (UTC)"],
                      rows, 3) if evals else _empty("etl eval"))

    # -- drift
    drift = ['<section id="drift"><h2>Drift</h2><p class="sub">Latest score per tenant, stage and metric against '
             "its threshold (black line); red bars are over it.</p>"]
    if drifts:
        newest: dict[tuple[str, str, str], Row] = {}
        for r in drifts:  # newest first: the first seen per key is the latest
            newest.setdefault((who(r), r["stage"], r["metric"]), r)
        bars = [(f"{k[0]} · {k[1]} · {k[2]}", [(r["score"], ALERT if r["score"] > r["threshold"] else CALM)],
                 r["threshold"], f"{r['score']:.3g} / {r['threshold']:.3g}") for k, r in sorted(newest.items())]
        top = max(max(r["score"], r["threshold"]) for r in newest.values())
        drift.append(_legend([("over threshold", ALERT), ("within threshold", CALM), ("threshold", "#1f2933")])
                     + _bar_chart(bars, top, lambda v: f"{v:g}", "drift score (score / threshold at right)"))
        drift.append(_table(["When (UTC)", "Tenant", "Stage", "Metric", "Baseline", "Recent", "Score", "Threshold",
                             "Window"], [[_when(r["at"]), _e(who(r)), _e(r["stage"]), _e(r["metric"]),
                                          f"{r['baseline']:.3g}", f"{r['recent']:.3g}",
                                          f'<span class="{"bad" if r["score"] > r["threshold"] else ""}">'
                                          f"{r['score']:.3g}</span>", f"{r['threshold']:.3g}", str(r["window"])]
                                         for r in drifts[:50]], 4))
    else:
        drift.append(_empty("etl drift"))

    # -- grounding and calibration
    trust = ['<section id="grounding"><h2>Grounding and calibration</h2><p class="sub">Grounded: the share of '
             "extracted values found in their document's text (<code>field_spans</code>). Calibration: on the "
             "golden set (needs confidences: a backend that reports log-probabilities, or long documents), how often "
             "values of a given confidence are right (expected calibration error, ECE: 0 is "
             "perfect; dots on the diagonal are calibrated).</p>"]
    if grounded:
        trust.append(_table(["Tenant", "Stage", "Values", "Grounded", "Ungrounded", "With a confidence",
                             "Mean confidence"],
                            [[_e(who(r)), _e(r["stage"]), f"{r['values']:,.0f}", f"<b>{_pct(r['grounded'] / r['values'])}</b>",
                              f"{r['values'] - r['grounded']:,.0f}", _pct(r["confident"] / r["values"]),
                              "–" if r["mean_confidence"] is None else f"{r['mean_confidence']:.3f}"]
                             for r in grounded], 2))
    else:
        trust.append(_empty("etl run"))
    calibrated = {k: runs[-1] for k, runs in latest.items() if (runs[-1].get("details") or {}).get("calibration")}
    if calibrated:
        trust.append("<h3>Calibration on the golden set (latest eval per tenant, stage and model)</h3>")
        by_stage: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
        for (t, _, stage, model), r in sorted(calibrated.items()):
            by_stage.setdefault(stage, []).append((f"{t} · {model}", colours[t], r["details"]["calibration"]))
        for stage, runs in by_stage.items():
            trust.append(f"<h3>{_e(stage)}</h3>" + _legend([(label, c) for label, c, _ in runs]) + _reliability(runs))
        trust.append(_table(["Tenant", "Stage", "Model", "ECE", "Values", "Confidence from", "When (UTC)"], [
            [_e(t), _e(stage), _e(model), f"<b>{r['details']['calibration']['ece']:.3f}</b>",
             str(r["details"]["calibration"]["pairs"]),
             _e(", ".join(f"{k} {v}" for k, v in sorted(r["details"]["calibration"].get("sources", {}).items()))),
             _when(r["at"])] for (t, _, stage, model), r in sorted(calibrated.items())], 3))
    else:
        trust.append(_empty("etl eval"))

    # -- stability
    steady = ['<section id="stability"><h2>Stability</h2><p class="sub">The same documents asked again '
              "(<code>etl stability</code>, the cache bypassed): the share answered one way every time, with its "
              "95% interval, distinct answers per document, the chance two answers differ in label, and the share "
              "of stored answers the model gives again. Latest run per tenant, stage and model; the change is "
              "against the last run it compares with (the same fingerprint, samples and documents' source).</p>"]
    if stable:
        last_runs: dict[tuple[str, str, str], list[Row]] = {}
        for r in stable:
            last_runs.setdefault((who(r), r["stage"], r["model"]), []).append(r)
        srows = []
        def comparable(a: Row, b: Row) -> bool:  # as etl stability compares: same fingerprint, K and source
            return (a["fingerprint"], a["samples"], (a["details"] or {}).get("source")) == (
                b["fingerprint"], b["samples"], (b["details"] or {}).get("source"))

        for (t, stage, model), runs in sorted(last_runs.items()):
            r, change = runs[-1], ""
            before = next((p for p in reversed(runs[:-1]) if comparable(p, r)), None)
            if before is not None:
                d = (r["unanimous"] - before["unanimous"]) * 100
                change = (f'<span class="{"up" if d > 0 else "down"}">{"▲" if d > 0 else "▼"} {abs(d):.1f} pts</span>'
                          if round(d, 1) else "= 0.0 pts")
            low, high = (r["details"] or {}).get("unanimous_ci") or (None, None)
            srows.append([_e(t), _e(stage), _e(model), f"<b>{_pct(r['unanimous'])}</b>",
                          "–" if low is None else f"{_pct(low)}–{_pct(high)}", change, f"{r['distinct_answers']:.2f}",
                          _pct(r["label_flip_rate"]), _pct(r["reproduced"]), f"{r['documents']} × {r['samples']}",
                          _when(r["at"])])
        steady.append(_table(["Tenant", "Stage", "Model", "One answer", "95% interval", "Change", "Distinct/doc",
                              "Label flips", "Reproduced", "Docs × samples", "When (UTC)"], srows, 3))
    else:
        steady.append(_empty("etl stability"))

    # -- cost and cache savings
    first, last = (min(str(r["first"]) for r in costs), max(str(r["last"]) for r in costs)) if costs else ("", "")
    span = "" if not costs else f" on {first}" if first == last else f" from {first} to {last}"
    cost = ['<section id="cost"><h2>Cost and cache savings per tenant</h2><p class="sub">What model calls cost '
            f"(retries included) and what cache hits saved{_e(span)}; the right column is the share saved.</p>"]
    if costs:
        bars = [(who(r), [(r["cost"], SPENT), (r["saved"], SAVED)], None,
                 f"{_pct(r['saved'] / (r['cost'] + r['saved'])) if r['cost'] + r['saved'] else '–'} saved")
                for r in costs]
        cost.append(_legend([("spent", SPENT), ("saved by cache", SAVED)]) + _bar_chart(
            bars, max(r["cost"] + r["saved"] for r in costs), _usd, "USD"))
        cost.append(_table(["Tenant", "Stage runs", "LLM calls", "Cache hit rate", "Failure rate", "Tokens", "Spent",
                            "Saved"], [[_e(who(r)), f"{r['stage_runs']:,.0f}", f"{r['llm_calls']:,.0f}",
                                        _pct(r["cache_hits"] / r["stage_runs"] if r["stage_runs"] else None),
                                        _pct(r["failed"] / r["stage_runs"] if r["stage_runs"] else None),
                                        f"{r['tokens']:,.0f}", _usd(r["cost"]), f"<b>{_usd(r['saved'])}</b>"]
                                       for r in costs], 1))
    else:
        cost.append(_empty("etl run"))
    if answered:
        per_stage: dict[tuple[str, str, str], int] = {}
        for r in answered:
            per_stage[(r["pipeline"], r["tenant"], r["stage"])] = per_stage.get(
                (r["pipeline"], r["tenant"], r["stage"]), 0) + r["results"]
        cost.append("<h3>Who answered</h3><p class=\"sub\">Stored results by the model that gave them: the main "
                    "model, a budget's cheaper fallback over its soft limit, or a router's student.</p>")
        cost.append(_table(["Tenant", "Stage", "Model", "Results", "Share of the stage"], [
            [_e(who(r)), _e(r["stage"]), _e(r["model"]), f"{r['results']:,}",
             _pct(r["results"] / per_stage[(r["pipeline"], r["tenant"], r["stage"])])] for r in answered], 3))

    over = sum(1 for r in drifts if r["score"] > r["threshold"])
    cards = [("eval runs", str(len(evals))), ("drift alerts over threshold", str(over)),
             ("spent", _usd(sum(r["cost"] for r in costs))), ("saved by cache", _usd(sum(r["saved"] for r in costs)))]
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    scope = f" · pipeline <code>{_e(pipeline)}</code>" if pipeline else " · all pipelines"
    page = ('<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>idem-etl quality report</title><style>{CSS}</style>'
            f"</head><body><main><header><h1>idem-etl quality report</h1><p>Generated {now}{scope}</p>"
            '<div class="cards">' + "".join(f"<div class=card><span>{k}</span><b>{v}</b></div>" for k, v in cards)
            + "</div></header>" + "".join(acc) + "</section>" + "".join(drift) + "</section>" + "".join(trust) + "</section>" + "".join(steady) + "</section>" + "".join(cost)
            + "</section></main></body></html>")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
