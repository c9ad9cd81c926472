"""Quality per tenant: drift without a deploy, evals on a golden set, review sampling, budgets,
overrides (analysts: test_tenancy.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from connectors.store import make_engine
from etl import Classify, Pipeline, run_pipeline
from etl.cli import app
from etl.quality.drift import detect
from etl.tenancy import ReviewSampling
from etl.testing import FakeLLM, ListSource
from tests.conftest import EXAMPLES
from tests.helpers import rows

LABELS = ["billing", "technical", "account", "other"]


def drifting_llm() -> FakeLLM:
    """Same model name throughout; halfway through, tenant "shifty" starts getting mostly "other"."""
    calls: Counter[str] = Counter()

    def answer(request):  # type: ignore[no-untyped-def]
        doc = request.messages[-1]["content"]
        tenant = doc.split("]")[0].strip("[")
        calls[tenant] += 1
        n = int(doc.split("#")[1])
        if tenant == "shifty" and calls[tenant] > 400 and n % 10:
            return {"label": "other"}
        return {"label": LABELS[n % 4]}

    return FakeLLM(answer=answer, model_id="provider-model-v1")


async def test_drift_alert_for_the_changed_tenant_only(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [{"id": f"{t}-{i}", "tenant": t, "text": f"[{t}] ticket #{i}"}
            for i in range(800) for t in ("steady", "shifty")]
    p = Pipeline("support", ListSource(docs), [Classify(LABELS, "Route.", name="route")], store=store_url)
    await run_pipeline(p, llm=drifting_llm())
    alerts = detect(make_engine(store_url), "support", window=200)
    with capsys.disabled():  # the figures belong in CI's output
        print("\ndrift figures:", [(a.tenant, a.stage, a.metric, round(a.baseline, 3), round(a.recent, 3),
                                    round(a.score, 3), a.threshold) for a in alerts])
    assert {a.tenant for a in alerts} == {"shifty"}
    shift = next(a for a in alerts if a.metric == "label_shift")
    # the label that moved most is "other": ~90% of the latest window; in the baseline (the first 600,
    # what comes before the latest window) a quarter of the first 400 and ~90% of the 200 after: 0.467
    assert shift.stage == "route" and abs(shift.baseline - 280 / 600) < 0.01 and shift.recent > 0.8
    assert shift.threshold == 3.0 and shift.score > shift.threshold
    assert rows(store_url, "SELECT tenant, metric FROM drift_alerts") == [(a.tenant, a.metric) for a in alerts]


async def test_a_version_the_provider_moved_under_the_same_name_is_a_drift_alert(store_url: str) -> None:
    def docs(start: int) -> ListSource:
        return ListSource([{"id": str(i), "tenant": "acme", "text": f"ticket {i}"} for i in range(start, start + 50)])

    stages = [Classify(LABELS, "Route.", name="route")]
    for start, version in ((0, "gpt-x-2025-01-01"), (50, "gpt-x-2025-01-01"), (100, "gpt-x-2025-06-01")):
        # the same configured name (model_id, so the same fingerprint); the provider reports the version
        await run_pipeline(Pipeline("support", docs(start), stages, store=store_url),
                           llm=FakeLLM(model_id="gpt-x", reported=version))
    assert {fp for (fp,) in rows(store_url, "SELECT DISTINCT fingerprint FROM stage_results")}.__len__() == 1
    alerts = [a for a in detect(make_engine(store_url), "support", window=20) if a.metric == "model_version"]
    assert [(a.tenant, a.stage, a.baseline, a.recent, a.extra) for a in alerts] == [
        ("acme", "route", 100 / 150, 50 / 150, {"from": "gpt-x-2025-01-01", "to": "gpt-x-2025-06-01"})]
    assert rows(store_url, "SELECT metric FROM drift_alerts") == [("model_version",)]
    # alerted once: the same move is not alerted again
    assert not [a for a in detect(make_engine(store_url), "support", window=20) if a.metric == "model_version"]
    # one version throughout: no alert
    await run_pipeline(Pipeline("steady", docs(0), stages, store=store_url), llm=FakeLLM(model_id="gpt-x"))
    assert not [a for a in detect(make_engine(store_url), "steady", window=20) if a.metric == "model_version"]


@pytest.mark.model
def test_eval_on_banking77_golden_records_accuracy_per_tenant(tmp_path: Path, sqlite_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The real local model, scored on 40 banking77 examples (two tenants), through the CLI."""
    golden = tmp_path / "golden.jsonl"
    golden.write_text("".join((EXAMPLES / "banking77_golden.jsonl").read_text().splitlines(keepends=True)[:40]))
    (tmp_path / "p.py").write_text(
        "import json\nfrom etl import Classify, Pipeline\n"
        f"INTENTS = json.load(open({str(EXAMPLES / 'banking77_categories.json')!r}))\n"
        f"pipeline = Pipeline('banking', {str(EXAMPLES / 'banking77.jsonl')!r}, "
        "[Classify(INTENTS, \"Classify the bank customer's message by its intent.\", name='intent')])\n")
    env = {"ETL_DATABASE_URL": sqlite_url}
    cli = CliRunner()
    imported = cli.invoke(app, ["golden", "import", str(golden), "--pipeline", "banking", "--stage", "intent"], env=env)
    assert imported.exit_code == 0 and "40 golden example(s)" in imported.output, imported.output
    evaluated = cli.invoke(app, ["eval", str(tmp_path / "p.py")], env=env)
    assert evaluated.exit_code == 0, evaluated.output
    runs = rows(sqlite_url, "SELECT tenant, examples, accuracy, macro_f1, model FROM eval_runs ORDER BY tenant")
    with capsys.disabled():  # the figures belong in CI's output
        print("\neval figures:", runs)
    assert [(t, n) for t, n, *_ in runs] == [("acme", 20), ("globex", 20)]
    results = rows(sqlite_url, "SELECT tenant, correct FROM eval_results")
    for tenant, _, accuracy, _, _ in runs:
        mine = [c for t, c in results if t == tenant]
        assert accuracy == pytest.approx(sum(mine) / len(mine))  # accuracy is what the rows say
    assert rows(sqlite_url, "SELECT count(*) FROM llm_calls WHERE pipeline = 'banking#eval'")[0][0] >= 40
    report = cli.invoke(app, ["report", "--out", str(tmp_path / "report")], env=env)
    assert report.exit_code == 0, report.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert "acme" in page and "globex" in page and "<svg" in page
    assert f"{runs[0][2] * 100:.1f}%" in page  # the report shows acme's accuracy


async def test_review_sampling_export_import_and_promote(tmp_path: Path, sqlite_url: str) -> None:
    docs = [{"id": str(i), "tenant": "acme", "text": f"ticket {i}"} for i in range(200)]
    p = Pipeline("support", ListSource(docs), [Classify(LABELS, "Route.")], store=sqlite_url,
                 review=ReviewSampling(rate=0.05))
    await run_pipeline(p, llm=FakeLLM())
    queued = rows(sqlite_url, "SELECT sampled_because, count(*) FROM review_queue GROUP BY 1 ORDER BY 1")
    assert dict(queued)["first_label"] == 4  # one first sighting per label
    assert 3 <= dict(queued)["uniform"] <= 20
    # a redelivery samples nothing new
    before = rows(sqlite_url, "SELECT count(*) FROM review_queue")
    await run_pipeline(Pipeline("support", ListSource(docs), p.stages, store=sqlite_url,
                                review=ReviewSampling(rate=0.05)), llm=FakeLLM())
    assert rows(sqlite_url, "SELECT count(*) FROM review_queue") == before
    env = {"ETL_DATABASE_URL": sqlite_url}
    exported = tmp_path / "review.jsonl"
    assert CliRunner().invoke(app, ["review", "export", "--out", str(exported)], env=env).exit_code == 0
    items = [json.loads(line) for line in exported.read_text().splitlines()]
    assert len(items) == before[0][0] and all(i["content"].startswith("ticket") for i in items)
    for i, item in enumerate(items):
        item["verdict"] = "correct" if i % 2 else "incorrect"
        item["corrected"] = None if i % 2 else {"label": "account"}
    exported.write_text("".join(json.dumps(i) + "\n" for i in items))
    result = CliRunner().invoke(app, ["review", "import", str(exported), "--promote", "--reviewer", "ana"], env=env)
    assert result.exit_code == 0, result.output
    assert rows(sqlite_url, "SELECT count(*) FROM review_queue WHERE status = 'reviewed' AND reviewer = 'ana'") == [
        (len(items),)]
    golden = rows(sqlite_url, "SELECT origin, count(*) FROM golden_examples GROUP BY 1")
    assert golden == [("review", len(items))]


async def test_daily_token_budget_quarantines_the_excess(sqlite_url: str) -> None:
    docs = [{"id": f"{t}{i}", "tenant": t, "text": f"{t} ticket {i}"} for i in range(10) for t in ("acme", "globex")]
    p = Pipeline("support", ListSource(docs), [Classify(LABELS, "Route.")], store=sqlite_url,
                 budgets={"acme": 300})  # FakeLLM spends 120 tokens a call
    llm = FakeLLM(tokens=(100, 20))
    stats = await run_pipeline(p, llm=llm)
    assert rows(sqlite_url, "SELECT tenant, reason, count(*) FROM dead_letters GROUP BY 1, 2") == [
        ("acme", "budget_exceeded", 7)]
    assert stats.results_written == 13 and stats.messages == 20
    spent = rows(sqlite_url, "SELECT sum(tokens_in + tokens_out) FROM llm_calls WHERE tenant = 'acme'")[0][0]
    assert spent == 360  # three calls: the budget is checked before each call


async def test_tenant_overrides_change_prompt_and_key_for_that_tenant_only(sqlite_url: str) -> None:
    docs = [{"id": "1", "tenant": "acme", "text": "same text"}, {"id": "2", "tenant": "globex", "text": "same text"}]
    p = Pipeline("support", ListSource(docs), [Classify(LABELS, "Route.", name="route")], store=sqlite_url,
                 tenant_overrides={"acme": {"route": {"instructions": "Route, Acme style.",
                                                      "labels": [*LABELS, "acme-vip"]}}})
    llm = FakeLLM()
    await run_pipeline(p, llm=llm)
    prompts = {c.messages[-1]["content"]: c.messages[0]["content"] for c in llm.calls}
    assert len(llm.calls) == 2
    acme, globex = (c.messages[0]["content"] for c in sorted(llm.calls, key=lambda c: "Acme" not in c.messages[0]["content"]))
    assert "Acme style" in acme and "acme-vip" in acme and "Acme" not in globex and "acme-vip" not in globex
    assert len(prompts) == 1  # same document text, two prompts, two fingerprints
    assert len({k for (k,) in rows(sqlite_url, "SELECT fingerprint FROM stage_results")}) == 2


async def test_a_deliberate_model_change_is_a_new_reference_not_drift(store_url: str) -> None:
    """The windows hold one fingerprint, the newest result's: a new model (or prompt) answering
    another label mix starts a new reference instead of alerting forever against the old one."""
    def docs(first: int) -> list[dict[str, str]]:
        return [{"id": f"d{i}", "tenant": "t", "text": f"[t] ticket #{i}"} for i in range(first, first + 400)]

    stage = [Classify(LABELS, "Route.", name="route")]
    old = FakeLLM(answer=lambda request: {"label": LABELS[int(request.messages[-1]["content"].split("#")[1]) % 4]},
                  model_id="provider-model-v1")
    await run_pipeline(Pipeline("support", ListSource(docs(0)), stage, store=store_url), llm=old)
    new = FakeLLM(answer=lambda request: {"label": "other"}, model_id="provider-model-v2")
    await run_pipeline(Pipeline("support", ListSource(docs(400)), stage, store=store_url), llm=new)
    assert [a.metric for a in detect(make_engine(store_url), "support", window=100)] == []
    # the same answers under the old fingerprint would have been drift: the test can fail
    moved = FakeLLM(answer=lambda request: {"label": "other"}, model_id="provider-model-v1")
    await run_pipeline(Pipeline("support", ListSource(docs(800)), stage, store=store_url), llm=moved)
    assert "label_shift" in [a.metric for a in detect(make_engine(store_url), "support", window=100)]


async def test_the_failure_rates_compare_attempts_of_the_newest_fingerprint_only(store_url: str) -> None:
    """A model that needed repairs, replaced by one that does not: no validation-failure alert."""
    docs = [{"id": f"d{i}", "tenant": "t", "text": f"[t] ticket #{i}"} for i in range(400)]
    stage = [Classify(LABELS, "Route.", name="route")]

    def sloppy(request):  # type: ignore[no-untyped-def]
        n = int(request.messages[-1]["content"].split("#")[1])
        repair = any(m["role"] == "assistant" for m in request.messages)
        return '{"label": "nope"}' if n % 2 and not repair else {"label": LABELS[n % 4]}

    await run_pipeline(Pipeline("support", ListSource(docs), stage, store=store_url),
                       llm=FakeLLM(answer=sloppy, model_id="v1"))
    newer = [{**d, "id": f"n{i}", "text": f"[t] new ticket #{i}"} for i, d in enumerate(docs)]
    await run_pipeline(Pipeline("support", ListSource(newer), stage, store=store_url),
                       llm=FakeLLM(answer=lambda request: {"label": "billing"}, model_id="v2"))
    assert [a.metric for a in detect(make_engine(store_url), "support", window=100)] == []
