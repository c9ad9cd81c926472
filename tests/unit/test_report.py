"""The quality report renders from a migrated store: empty sections say how to fill them, populated
ones chart and tabulate exactly what is stored, and a pipeline filter keeps other pipelines out."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pytest
from sqlalchemy import Engine, insert

from connectors.store import make_engine, upgrade
from connectors.store.tables import drift_alerts, eval_runs, llm_calls, stability_runs
from etl.quality.report import ALERT, write_report

T0 = dt.datetime(2025, 3, 1, 9, 0)


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = make_engine(f"sqlite:///{tmp_path}/t.db")
    upgrade(engine)
    return engine


def section(page: str, name: str) -> str:
    match = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert match, f"no {name} section"
    return match.group(1)


def table_row(part: str, first_cell: str) -> str:
    """The <tr> of a section's table whose first cell is ``first_cell``."""
    match = re.search(rf"<tr><td>{re.escape(first_cell)}</td>(.*?)</tr>", part)
    assert match, f"no row for {first_cell}"
    return match.group(1)


def populate(engine: Engine) -> None:
    run = {"stage": "classify", "model": "m1", "failed": 0, "details": {}}
    calls = {"stage": "classify", "doc_key": "d", "cache_key": "k", "model": "m1", "tokens_in": 10, "tokens_out": 5,
             "latency_ms": 100.0, "error": None}
    drift = {"stage": "classify", "baseline": 0.1, "window": 50}
    with engine.begin() as conn:
        conn.execute(insert(eval_runs), [
            {**run, "pipeline": "p1", "tenant": "acme", "fingerprint": "aaaaaaaa1111", "examples": 20,
             "accuracy": 0.8, "macro_f1": 0.71, "created_at": T0},
            {**run, "pipeline": "p1", "tenant": "acme", "fingerprint": "bbbbbbbb2222", "examples": 20,
             "accuracy": 0.9, "macro_f1": 0.85, "created_at": T0 + dt.timedelta(days=2)},
            {**run, "pipeline": "p1", "tenant": "globex", "fingerprint": "cccccccc3333", "examples": 8,
             "accuracy": 0.75, "macro_f1": None, "created_at": T0 + dt.timedelta(days=1)},
            {**run, "pipeline": "p2", "tenant": "initech", "fingerprint": "dddddddd4444", "examples": 5,
             "accuracy": 0.5, "macro_f1": None, "created_at": T0},
        ])
        conn.execute(insert(drift_alerts), [
            {**drift, "pipeline": "p1", "tenant": "acme", "metric": "label_shift", "recent": 0.5, "score": 4.5,
             "threshold": 3.0},
            {**drift, "pipeline": "p1", "tenant": "globex", "metric": "refusal_rate", "recent": 0.15, "score": 0.05,
             "threshold": 0.1},
            {**drift, "pipeline": "p2", "tenant": "initech", "metric": "label_shift", "recent": 0.9, "score": 3.7,
             "threshold": 3.0},
        ])
        steady = {"pipeline": "p1", "stage": "classify", "model": "m1", "fingerprint": "f", "samples": 5, "calls": 500,
                  "cost": 0.5, "reproduced": 0.9}
        conn.execute(insert(stability_runs), [
            {**steady, "tenant": "acme", "documents": 100, "unanimous": 0.95, "distinct_answers": 1.05,
             "label_flip_rate": 0.02, "details": {"unanimous_ci": [0.89, 0.98]}, "created_at": T0},
            {**steady, "tenant": "acme", "documents": 100, "unanimous": 0.8, "distinct_answers": 1.25,
             "label_flip_rate": 0.1, "details": {"unanimous_ci": [0.71, 0.87]}, "created_at": T0 + dt.timedelta(days=1)},
            {**steady, "pipeline": "p2", "tenant": "initech", "documents": 10, "unanimous": 0.5, "distinct_answers": 2.0,
             "label_flip_rate": 0.3, "details": {}, "created_at": T0},
        ])
        conn.execute(insert(llm_calls), [{**calls, **row} for row in (
            # acme: spent 0.25 + 0.5 + 0.75 = $1.50 (the retry costs too), saved $0.50
            {"pipeline": "p1", "tenant": "acme", "outcome": "retry", "cost": 0.25, "error": "schema_invalid"},
            {"pipeline": "p1", "tenant": "acme", "outcome": "ok", "cost": 0.5},
            {"pipeline": "p1", "tenant": "acme", "outcome": "ok", "cost": 0.75},
            {"pipeline": "p1", "tenant": "acme", "outcome": "cache_hit", "cost": 0.5},
            # globex: spent 0.003 + 0.001 = $0.0040, saved 2 × 0.003 = $0.0060; 1 of 4 stage runs failed
            {"pipeline": "p1", "tenant": "globex", "outcome": "ok", "cost": 0.003},
            {"pipeline": "p1", "tenant": "globex", "outcome": "failed", "cost": 0.001, "error": "refusal"},
            {"pipeline": "p1", "tenant": "globex", "outcome": "cache_hit", "cost": 0.003},
            {"pipeline": "p1", "tenant": "globex", "outcome": "cache_hit", "cost": 0.003},
            {"pipeline": "p2", "tenant": "initech", "outcome": "ok", "cost": 9.0},
        )])


def test_an_empty_store_renders_a_note_per_section(engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "nested" / "report"
    path = write_report(engine, out)
    assert path == out / "index.html"
    page = path.read_text()
    assert "idem-etl quality report" in page
    assert page.count("No data yet") == 6  # grounding and calibration each say what fills them
    for name, command in (("accuracy", "etl eval"), ("drift", "etl drift"), ("cost", "etl run"),
                          ("stability", "etl stability"),
                          ("grounding", "etl run"), ("grounding", "etl eval")):
        assert f"<code>{command}</code>" in section(page, name)
    assert "<svg" not in page


def test_a_populated_store_renders_charts_and_exact_figures(engine: Engine, tmp_path: Path) -> None:
    populate(engine)
    page = write_report(engine, tmp_path / "out", pipeline="p1").read_text()
    assert "pipeline <code>p1</code>" in page
    accuracy, drift, cost = (section(page, name) for name in ("accuracy", "drift", "cost"))
    assert (accuracy.count("<svg"), drift.count("<svg"), cost.count("<svg")) == (1, 1, 1)
    for part in (accuracy, drift, cost):
        assert "acme" in part and "globex" in part

    # accuracy: one point per run, a line only for the tenant with two runs; the table shows the latest run
    svg = accuracy[accuracy.index("<svg"):accuracy.index("</svg>")]
    assert svg.count("<circle") == 3 and svg.count("<polyline") == 1
    assert "fingerprint bbbbbbbb" in svg and "bbbbbbbb2222" not in svg
    acme = table_row(accuracy, "acme")
    assert "<b>90.0%</b>" in acme and "0.850" in acme and "80.0%" not in acme and "▲ 10.0 pts" in acme
    assert "<b>75.0%</b>" in table_row(accuracy, "globex")

    # drift: only acme's score is over its threshold, so exactly one red bar
    assert drift.count(f'fill="{ALERT}"') == 1
    assert "4.5 / 3" in drift and "0.05 / 0.1" in drift

    # cost: spent and saved per tenant, computed from the llm_calls above
    acme, globex = table_row(cost, "acme"), table_row(cost, "globex")
    assert "$1.50" in acme and "<b>$0.50</b>" in acme and "33.3%" in acme  # 1 cache hit of 3 stage runs
    assert "$0.0040" in globex and "<b>$0.0060</b>" in globex and "25.0%" in globex  # 1 failed of 4
    assert "50.0%" in globex  # cache hit rate: 2 of 4

    # stability: the latest run per tenant, its interval and the change from the run before
    acme = table_row(section(page, "stability"), "acme")
    assert "<b>80.0%</b>" in acme and "71.0%–87.0%" in acme and "▼ 15.0 pts" in acme and "1.25" in acme
    assert "10.0%" in acme and "90.0%" in acme and "100 × 5" in acme and "95.0%" not in acme

    # the other pipeline's rows are filtered out of every section
    assert "initech" not in page and "$9.00" not in page and "3.7 / 3" not in page


def test_without_a_filter_every_pipeline_shows_and_names_its_tenants(engine: Engine, tmp_path: Path) -> None:
    populate(engine)
    page = write_report(engine, tmp_path / "out").read_text()
    assert "all pipelines" in page
    assert "p2/initech" in section(page, "accuracy") and "p1/acme" in section(page, "accuracy")
    assert "$9.00" in table_row(section(page, "cost"), "p2/initech")
    assert section(page, "drift").count(f'fill="{ALERT}"') == 2


def test_store_strings_are_escaped(engine: Engine, tmp_path: Path) -> None:
    where = {"pipeline": "p", "tenant": "<script>x</script>", "stage": "s&t"}
    with engine.begin() as conn:
        conn.execute(insert(eval_runs), [{**where, "model": "m", "fingerprint": "f", "examples": 1, "failed": 0,
                                          "accuracy": 1.0, "macro_f1": None, "details": {}}])
        conn.execute(insert(drift_alerts), [{**where, "metric": "<i>m</i>", "baseline": 0.0, "recent": 1.0,
                                             "score": 1.0, "threshold": 0.5, "window": 10}])
        conn.execute(insert(llm_calls), [{**where, "doc_key": "d", "cache_key": "k", "model": "m", "outcome": "ok",
                                          "tokens_in": 1, "tokens_out": 1, "cost": 0.0, "latency_ms": 1.0}])
    page = write_report(engine, tmp_path / "out").read_text()
    assert "<script>" not in page and "<i>" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page and "s&amp;t" in page
    assert section(page, "accuracy").count("<circle") == 1  # a single run still renders as a point
