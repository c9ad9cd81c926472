"""``etl stability`` against a simulated provider of stated instability, through the CLI, on SQLite
and PostgreSQL: the figures match the stated rates within their confidence intervals, nothing
stored is read or overwritten, every answer is costed under ``#stability``, a drop in stability
is a drift alert, and ``--max-cost`` stops after two rounds."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from connectors.store import SqlStore
from connectors.store.prune import stored_pipelines
from etl.cli import app
from tests.conftest import EXAMPLES
from tests.helpers import rows

K = 5


def pipeline_file(tmp_path: Path) -> Path:
    """banking77's 200 demo messages (two tenants) through one Classify stage, answered by a
    simulated provider: 90% accurate, unstable on STABILITY_SHARE of the texts."""
    path = tmp_path / "p.py"
    path.write_text(f"""
import json, os
from etl import Classify, Pipeline
from etl.testing import FakeLLM, simulated_labeller, unstable

INTENTS = json.load(open({str(EXAMPLES / 'banking77_categories.json')!r}))
GOLD = {{r["text"]: r["gold"] for r in map(json.loads, open({str(EXAMPLES / 'banking77.jsonl')!r}))}}

def other(reply):
    return {{"label": INTENTS[(INTENTS.index(reply["label"]) + 1) % len(INTENTS)]}}

llm = FakeLLM(unstable(simulated_labeller(GOLD, INTENTS, accuracy=0.9), float(os.environ["STABILITY_SHARE"]), other,
                       seed=int(os.environ.get("STABILITY_SEED", "1"))),
              model_id="sim-unstable", price_per_mtok=(1.0, 2.0))
pipeline = Pipeline("banking", {str(EXAMPLES / 'banking77.jsonl')!r},
                    [Classify(INTENTS, "Classify the bank customer's message by its intent.", name="intent")], llm=llm)
""")
    return path


def within(value: float, interval: list[float]) -> bool:
    return interval[0] <= value <= interval[1]


def test_stability_matches_the_stated_instability_and_touches_nothing_stored(
        tmp_path: Path, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    share = 0.3
    env = {"ETL_DATABASE_URL": store_url, "STABILITY_SHARE": str(share)}
    p = str(pipeline_file(tmp_path))
    cli = CliRunner()
    ran = cli.invoke(app, ["run", p], env=env)
    assert ran.exit_code == 0, ran.output
    stored = rows(store_url, "SELECT tenant, doc_key, output, updated_at FROM stage_results ORDER BY tenant, doc_key")
    cached = rows(store_url, "SELECT cache_key, output FROM llm_cache ORDER BY cache_key")
    production_calls = rows(store_url, "SELECT count(*) FROM llm_calls WHERE pipeline = 'banking'")
    measured = cli.invoke(app, ["stability", p, "intent", "--samples", str(K), "--documents", "200"], env=env)
    assert measured.exit_code == 0, measured.output
    assert "200 documents from the pipeline's source × 5 samples" in measured.output
    runs = rows(store_url, "SELECT tenant, model, documents, samples, unanimous, distinct_answers, label_flip_rate, "
                           "reproduced, calls, cost, details FROM stability_runs ORDER BY tenant")
    runs = [(*r[:-1], json.loads(r[-1]) if isinstance(r[-1], str) else r[-1]) for r in runs]  # SQLite: JSON text
    with capsys.disabled():  # the figures belong in CI's output
        print("\nstability figures:", [(t, n, k, round(u, 3), round(f, 3), round(r, 3), d["unanimous_ci"])
                                       for t, _, n, k, u, _, f, r, _, _, d in runs])
    assert [(t, m, n, k) for t, m, n, k, *_ in runs] == [("acme", "sim-unstable", 100, K), ("globex", "sim-unstable", 100, K)]
    for _, _, n, _, unanimous, distinct, flip, reproduced, calls, cost, details in runs:
        # stated: K answers agree on 1 - s + s * 2^(1-K) of the documents, two differ on s/2 of the
        # pairs, and the stored answer (one draw) is the most common of K on 1 - s/2
        assert within(1 - share + share * 2 ** (1 - K), details["unanimous_ci"]), details
        assert within(share / 2, details["label_flip_rate_ci"]), (flip, details)
        assert within(1 - share / 2, details["reproduced_ci"]), (reproduced, details)
        assert details["stored_compared"] == n and 1 < distinct < 2 and details["max_distinct"] == 2
        assert calls == n * K and cost == pytest.approx(n * K * (100 * 1.0 + 20 * 2.0) / 1e6)
    assert unanimous < 1 and "95% interval" in measured.output
    # the measurement is not a run: nothing stored was read as an answer or changed, production
    # metrics are untouched, and every answer is costed apart
    assert rows(store_url, "SELECT tenant, doc_key, output, updated_at FROM stage_results ORDER BY tenant, doc_key") == stored
    assert rows(store_url, "SELECT cache_key, output FROM llm_cache ORDER BY cache_key") == cached
    assert rows(store_url, "SELECT count(*) FROM llm_calls WHERE pipeline = 'banking'") == production_calls
    assert rows(store_url, "SELECT count(*) FROM llm_calls WHERE pipeline = 'banking#stability'") == [(200 * K,)]
    # nor a tenant's traffic: its daily budget counts the run's tokens only, and `etl prune` knows
    # the measurement's rows are the pipeline's
    store = SqlStore(store_url)
    since = datetime(2000, 1, 1, tzinfo=timezone.utc)
    assert store.tokens_spent("acme", since) == 100 * (100 + 20)  # the run's 100 calls of (100, 20) tokens
    with store.engine.connect() as conn:
        assert stored_pipelines(conn) == {"banking"}
    store.engine.dispose()

    # the same model, less stable now: a drift alert per tenant
    worse = cli.invoke(app, ["stability", p, "intent", "--samples", str(K), "--documents", "200"],
                       env={**env, "STABILITY_SHARE": "0.8", "STABILITY_SEED": "2"})
    assert worse.exit_code == 0, worse.output
    assert "stability dropped from" in worse.output
    alerts = rows(store_url, "SELECT tenant, metric, baseline, recent, score, threshold FROM drift_alerts ORDER BY tenant")
    assert [(t, m) for t, m, *_ in alerts] == [("acme", "stability"), ("globex", "stability")]
    assert all(b > r and s > th for _, _, b, r, s, th in alerts), alerts
    report = cli.invoke(app, ["report", "--out", str(tmp_path / "report")], env=env)
    assert report.exit_code == 0, report.output


def test_max_cost_stops_after_two_rounds_and_the_samples_come_from_where_they_are_asked(tmp_path: Path, sqlite_url: str) -> None:
    env = {"ETL_DATABASE_URL": sqlite_url, "STABILITY_SHARE": "0.3"}
    p = str(pipeline_file(tmp_path))
    cli = CliRunner()
    cheap = cli.invoke(app, ["stability", p, "intent", "--samples", "5", "--documents", "20", "--max-cost", "0.000001"],
                       env=env)
    assert cheap.exit_code == 0, cheap.output
    # the first tenant stops after its two rounds; the cap reached, the next is not started
    [(tenant, n, samples, calls)] = rows(sqlite_url, "SELECT tenant, documents, samples, calls FROM stability_runs")
    assert tenant == "acme" and samples == 2 and calls == 2 * n
    assert "globex: not measured (--max-cost 1e-06 USD reached)" in cheap.output, cheap.output
    for bad in ("0", "-1", "nan"):
        refused = cli.invoke(app, ["stability", p, "intent", "--max-cost", bad], env=env)
        assert refused.exit_code == 1 and "give a positive number of USD" in refused.output, refused.output
    golden = tmp_path / "golden.jsonl"
    golden.write_text("".join(json.dumps({"id": r["id"], "tenant": r["tenant"], "text": r["text"], "label": r["gold"]})
                              + "\n" for r in map(json.loads, (EXAMPLES / "banking77.jsonl").read_text().splitlines()[:30])))
    assert cli.invoke(app, ["golden", "import", str(golden), "--pipeline", "banking", "--stage", "intent"],
                      env=env).exit_code == 0
    from_golden = cli.invoke(app, ["stability", p, "intent", "--from", "golden", "--samples", "3"], env=env)
    assert from_golden.exit_code == 0 and "30 documents from its golden set × 3 samples" in from_golden.output, (
        from_golden.output)
    for args, says in ((["nope"], "has no stage 'nope'"), (["intent", "--samples", "1"], "give 2 to 100 samples"),
                       (["intent", "--from", str(tmp_path / "missing")], "--from")):
        wrong = cli.invoke(app, ["stability", p, *args], env=env)
        assert wrong.exit_code == 1 and says in wrong.output and "Traceback" not in wrong.output, wrong.output
    streaming = tmp_path / "streaming.py"
    streaming.write_text(p_text := Path(p).read_text().replace(
        f"Pipeline(\"banking\", {str(EXAMPLES / 'banking77.jsonl')!r},", "Pipeline(\"banking\", KafkaSource(\"b\", "
        "bootstrap=\"127.0.0.1:9\", group=\"g\"),").replace("from etl import Classify", "from etl import Classify, KafkaSource"))
    assert "KafkaSource(" in p_text
    kafka = cli.invoke(app, ["stability", str(streaming), "intent"], env=env)
    assert kafka.exit_code == 1 and "--from golden or a file" in kafka.output, kafka.output
