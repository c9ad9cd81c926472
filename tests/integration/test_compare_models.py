"""``etl eval --models``: two simulated models of stated accuracy on the banking77 golden set
(100 examples, two tenants), through the CLI on SQLite and PostgreSQL: ranked correctly, with
intervals, cost and a paired test; a re-run costs no call; the pipeline's own model and stored
results are untouched; an unknown name is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from etl.cli import app
from tests.conftest import EXAMPLES
from tests.helpers import rows


def pipeline_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.py"
    path.write_text(f"""
import json
from etl import Classify, Pipeline
from etl.testing import FakeLLM, simulated_labeller

INTENTS = json.load(open({str(EXAMPLES / 'banking77_categories.json')!r}))
GOLD = {{r["text"]: r["label"] for r in map(json.loads, open({str(EXAMPLES / 'banking77_golden.jsonl')!r}))}}
pipeline = Pipeline(
    "banking", {str(EXAMPLES / 'banking77.jsonl')!r},
    [Classify(INTENTS, "Classify the bank customer's message by its intent.", name="intent")],
    llm=FakeLLM(simulated_labeller(GOLD, INTENTS, accuracy=0.7), model_id="current"),
    models={{"strong": FakeLLM(simulated_labeller(GOLD, INTENTS, accuracy=0.95, seed="s"), model_id="strong-2025-01-01",
                               price_per_mtok=(3.0, 15.0)),
             "weak": FakeLLM(simulated_labeller(GOLD, INTENTS, accuracy=0.6, seed="w"), model_id="weak-2025-01-01",
                             price_per_mtok=(0.15, 0.6))}},
)
""")
    return path


def test_two_models_are_ranked_on_the_golden_set_and_a_rerun_costs_nothing(
        tmp_path: Path, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ETL_DATABASE_URL": store_url}
    p = str(pipeline_file(tmp_path))
    cli = CliRunner()
    imported = cli.invoke(app, ["golden", "import", str(EXAMPLES / "banking77_golden.jsonl"), "--pipeline", "banking",
                                "--stage", "intent"], env=env)
    assert imported.exit_code == 0, imported.output
    first = cli.invoke(app, ["eval", p, "--models", "weak,strong,default"], env=env)
    assert first.exit_code == 0, first.output
    with capsys.disabled():  # the figures belong in CI's output
        print("\n" + first.output)
    table = [line for line in first.output.splitlines() if line.startswith("│")]
    order = [line.split("│")[1].strip() for line in table]
    assert order == ["strong", "default", "weak"], first.output  # 0.95 > 0.7 > 0.6, as stated
    assert "exact McNemar p =" in first.output and "beyond chance at 0.05" in first.output
    runs = rows(store_url, "SELECT model, tenant, examples, accuracy FROM eval_runs ORDER BY model, tenant")
    by_model = {m: sum(a * n for mm, _, n, a in runs if mm == m) / sum(n for mm, _, n, _ in runs if mm == m)
                for m in {m for m, *_ in runs}}
    assert abs(by_model["strong-2025-01-01"] - 0.95) < 0.08 and abs(by_model["weak-2025-01-01"] - 0.6) < 0.12
    calls = rows(store_url, "SELECT count(*) FROM llm_calls WHERE pipeline = 'banking#eval'")[0][0]
    assert calls == 300  # one per example and model
    second = cli.invoke(app, ["eval", p, "--models", "weak,strong,default"], env=env)
    assert second.exit_code == 0, second.output
    assert rows(store_url, "SELECT count(*) FROM llm_calls WHERE pipeline = 'banking#eval'")[0][0] == calls  # 0 calls
    assert [line.split("│")[1].strip() for line in second.output.splitlines() if line.startswith("│")] == order
    strip = lambda out: [line.rsplit("│", 2)[0] for line in out.splitlines() if line.startswith("│")]  # noqa: E731
    assert strip(second.output) == strip(first.output)  # the same figures, all from the cache
    assert rows(store_url, "SELECT count(*) FROM stage_results") == [(0,)]  # a comparison is not a run
    unknown = cli.invoke(app, ["eval", p, "--models", "weak,nope"], env=env)
    assert unknown.exit_code == 1 and "'nope' is not one of 'banking'" in unknown.output, unknown.output
    one = cli.invoke(app, ["eval", p, "--models", "weak"], env=env)
    assert one.exit_code == 1 and "name two or more" in one.output, one.output
