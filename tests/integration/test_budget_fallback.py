"""Over a tenant's soft budget a cheaper model answers, under its own fingerprint; over the hard
limit the tenant is quarantined as before (issue 30). On SQLite and PostgreSQL.

The promise around the switch: a document the main model answered is a no-op when redelivered
over the soft limit, and one the fallback answered is a no-op when redelivered under it (the budget
reset the next day, or raised): a stored or cached answer of either model is never paid again."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from connectors.store import make_engine
from dedup import cache_key, content_hash, normalize_content
from etl import Budget, Classify, ConfigError, Pipeline, Settings, run_pipeline
from etl.quality.report import write_report
from etl.runtime.wiring import build_runner
from etl.stages import StagePlan
from etl.testing import FakeLLM, ListSource
from tests.helpers import CORE_TABLES, counts, rows

LABELS = ["billing", "technical", "account", "other"]
STAGE = Classify(LABELS, "Route the ticket.", name="route")
ONE_AT_A_TIME = Settings(max_in_flight=1, flush_size=1)  # the budget is read before each call: exact counts


def docs(n: int, first: int = 0, tenant: str = "acme") -> list[dict[str, str]]:
    return [{"id": f"{tenant}-{i}", "tenant": tenant, "text": f"ticket number {i}"} for i in range(first, first + n)]


def models() -> tuple[FakeLLM, FakeLLM]:
    big = FakeLLM(model_id="big-model-2026-01-01", tokens=(100, 20))  # 120 tokens a call
    small = FakeLLM(model_id="small-model-2026-01-01", tokens=(50, 10))  # 60
    return big, small


def pipeline(url: str, items: list[dict[str, str]], budget: Budget | int, small: FakeLLM) -> Pipeline:
    del small  # the fallback is in the budget; named for the reader
    return Pipeline("support", ListSource(items), [STAGE], store=url, budgets={"acme": budget})


def fingerprint(llm: FakeLLM) -> str:
    return StagePlan.of(STAGE, llm, Settings().repairs).fingerprint


async def test_the_fallback_answers_over_the_soft_limit_and_nothing_is_mixed(store_url: str, tmp_path: Path) -> None:
    big, small = models()
    budget = Budget(tokens=10_000, soft=300, fallback=small)
    items = docs(10)
    stats = await run_pipeline(pipeline(store_url, items, budget, small), ONE_AT_A_TIME, llm=big)
    # 120 tokens a call: after 3 calls the tenant spent 360 >= 300, so the other 7 ask the fallback
    assert (len(big.calls), len(small.calls), stats.results_written, stats.dead_letters) == (3, 7, 10, 0)
    by_model = rows(store_url, "SELECT model, fingerprint, count(*) FROM stage_results GROUP BY 1, 2 ORDER BY 1")
    assert by_model == [(big.model_id, fingerprint(big), 3), (small.model_id, fingerprint(small), 7)]
    # nothing mixed in the cache: each fingerprint holds its own model's answers, under its own keys
    cached = rows(store_url, "SELECT cache_key, fingerprint, model, tenant FROM llm_cache")
    assert {(fp, model) for _, fp, model, _ in cached} == {(fingerprint(big), big.model_id),
                                                          (fingerprint(small), small.model_id)}
    text_of = {d["id"]: d["text"] for d in items}
    for key, fp, doc_key in rows(store_url, "SELECT cache_key, fingerprint, doc_key FROM stage_results"):
        assert key == cache_key("acme", fp, content_hash(normalize_content(text_of[doc_key])))
    calls = rows(store_url, "SELECT model, outcome, count(*) FROM llm_calls GROUP BY 1, 2 ORDER BY 1")
    assert calls == [(big.model_id, "ok", 3), (small.model_id, "ok", 7)]
    before = counts(store_url, CORE_TABLES)

    # redelivered over the soft limit: the 3 answered by the main model are no-ops too
    again_big, again_small = models()
    await run_pipeline(pipeline(store_url, items, budget, again_small), ONE_AT_A_TIME, llm=again_big)
    assert (len(again_big.calls), len(again_small.calls)) == (0, 0)
    assert counts(store_url, CORE_TABLES) == before

    # the next day (a budget that is not spent): the 7 the fallback answered stay no-ops
    later_big, later_small = models()
    fresh = Budget(tokens=10_000, soft=9_999, fallback=later_small)
    stats = await run_pipeline(pipeline(store_url, items, fresh, later_small), ONE_AT_A_TIME, llm=later_big)
    assert (len(later_big.calls), len(later_small.calls), stats.results_written) == (0, 0, 0)
    assert counts(store_url, CORE_TABLES) == before

    # a copy of a fallback-answered content under another key takes the cached answer (no call);
    # a new content under the soft limit is the main model's again
    copy = {"id": "acme-copy", "tenant": "acme", "text": items[-1]["text"]}
    new = {"id": "acme-new", "tenant": "acme", "text": "a ticket nobody asked about"}
    stats = await run_pipeline(pipeline(store_url, [*items, copy, new], fresh, later_small), ONE_AT_A_TIME,
                               llm=later_big)
    assert (len(later_big.calls), len(later_small.calls), stats.results_written) == (1, 0, 2)
    assert rows(store_url, "SELECT doc_key, model, cache_hit FROM stage_results WHERE doc_key IN "
                           "('acme-copy', 'acme-new') ORDER BY doc_key") == [
        ("acme-copy", small.model_id, True), ("acme-new", big.model_id, False)]

    # the report says who answered: 4 results of the main model, 8 of the fallback
    engine = make_engine(store_url)
    try:
        page = write_report(engine, tmp_path / "report").read_text()
    finally:
        engine.dispose()
    who = page[page.index("<h3>Who answered</h3>"):]
    for model, n, share in ((small.model_id, 8, "66.7%"), (big.model_id, 4, "33.3%")):
        assert re.search(rf"<td>acme</td><td>route</td><td>{model}</td><td[^>]*>{n}</td><td[^>]*>{share}</td>", who), who


async def test_over_the_hard_limit_the_tenant_is_quarantined_whoever_answers(store_url: str) -> None:
    big, small = models()
    budget = Budget(tokens=420, soft=300, fallback={"route": small})
    items = [*docs(6), *docs(2, tenant="globex")]
    stats = await run_pipeline(pipeline(store_url, items, budget, small), ONE_AT_A_TIME, llm=big)
    # acme: 3 main calls (360), one fallback call (420, the hard limit), then quarantine; globex has no budget
    assert (len(small.calls), stats.results_written) == (1, 6)
    assert rows(store_url, "SELECT tenant, reason, count(*) FROM dead_letters GROUP BY 1, 2") == [
        ("acme", "budget_exceeded", 2)]
    spent = rows(store_url, "SELECT sum(tokens_in + tokens_out) FROM llm_calls WHERE tenant = 'acme'")[0][0]
    assert spent == 420
    before, calls = counts(store_url, CORE_TABLES), len(big.calls)
    # a redelivery of everything (letters included) is a no-op over the limit
    again_big, again_small = models()
    await run_pipeline(pipeline(store_url, items, budget, again_small), ONE_AT_A_TIME, llm=again_big)
    assert (len(again_big.calls), len(again_small.calls), calls) == (0, 0, 5)
    assert counts(store_url, CORE_TABLES) == before


def test_a_budget_says_what_is_wrong_with_it() -> None:
    _, small = models()
    with pytest.raises(ConfigError, match="names no fallback"):
        Budget(tokens=100, soft=50)
    with pytest.raises(ConfigError, match="between 0 and tokens"):
        Budget(tokens=100, soft=200, fallback=small)
    with pytest.raises(ConfigError, match="whole number"):
        Budget(tokens=-1)
    for wrong in ("small-model", {"route": "small-model"}, {}, [small]):
        with pytest.raises(ConfigError, match="give a model"):
            Budget(tokens=100, fallback=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown stage\(s\) \['rout'\]"):
        Pipeline("support", ListSource([]), [STAGE], budgets={"acme": Budget(100, fallback={"rout": small})})
    assert Budget(1000, fallback=small).soft_limit == 800 and Budget(1000).soft_limit is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Pipeline("support", ListSource([]), [STAGE], budgets={"acme": 5}).budgets["acme"] == Budget(5)


async def test_two_workers_that_disagree_on_the_budget_ask_one_model(postgres_url: str) -> None:
    """Each worker counts its own calls, so one can be over the soft limit while another is not: a
    message both read (a rebalance) is still asked of one model once, because the claim is the main
    plan's key whichever model answers. (Found by review: each claimed its own model's key.)"""
    item = [{"id": "d1", "tenant": "acme", "text": "the same ticket"}]

    def worker(spent: int) -> tuple[Any, FakeLLM, FakeLLM]:
        big, small = FakeLLM(model_id="big", latency_s=0.5), FakeLLM(model_id="small", latency_s=0.5)
        p = Pipeline("support", ListSource(item), [STAGE], store=postgres_url,
                     budgets={"acme": Budget(tokens=10_000, soft=1_000, fallback=small)})
        runner = build_runner(p, ONE_AT_A_TIME, llm=big)
        # this worker's own view of today's spend: the other worker's calls are not in it
        runner.executor.calls.budgets._spent[("acme", dt.datetime.now(dt.UTC).date())] = spent  # type: ignore[union-attr]
        return runner, big, small

    (a, a_big, a_small), (b, b_big, b_small) = worker(0), worker(1_500)
    await asyncio.gather(a.run(), b.run())
    assert len(a_big.calls) + len(a_small.calls) + len(b_big.calls) + len(b_small.calls) == 1
    assert rows(postgres_url, "SELECT outcome, count(*) FROM llm_calls GROUP BY 1 ORDER BY 1") == [
        ("cache_hit", 1), ("ok", 1)]
    assert rows(postgres_url, "SELECT count(*) FROM llm_claims") == [(0,)]


async def test_a_restated_copy_over_the_soft_limit_pays_nothing_it_holds(sqlite_url: str) -> None:
    """A producer retry of a document whose first stage the main model answered, its second stage's
    prompt changed, over the soft limit: the copy takes the first stage from the cache (no call,
    no call row), the changed stage is the fallback's. (Found by review: the copy paid the fallback
    for the first stage, whose keys were not among the copy's restated ones.)"""
    def stages(prompt: str) -> list[Classify]:
        return [Classify(["a", "b"], "Pick.", name="route"), Classify(["x", "y"], prompt, name="tone")]

    doc = {"id": "d", "tenant": "acme", "text": "hello"}
    first = Budget(10**6, soft=10**6 - 1, fallback=FakeLLM(model_id="small"))
    await run_pipeline(Pipeline("p", ListSource([doc]), stages("v1"), store=sqlite_url, budgets={"acme": first}),
                       llm=FakeLLM(model_id="big"))
    big, small = FakeLLM(model_id="big"), FakeLLM(model_id="small")
    await run_pipeline(Pipeline("p", ListSource([doc, doc]), stages("v2"), store=sqlite_url,
                                budgets={"acme": Budget(10**6, soft=0, fallback=small)}),
                       Settings(max_in_flight=4, flush_size=100), llm=big)
    assert (len(big.calls), len(small.calls)) == (0, 1)
    assert sorted(rows(sqlite_url, "SELECT stage, model, outcome FROM llm_calls")) == [
        ("route", "big", "ok"), ("tone", "big", "ok"), ("tone", "small", "ok")]
    assert sorted(rows(sqlite_url, "SELECT r.stage, r.model, d.message_offset FROM stage_results r JOIN documents d "
                                   "USING (pipeline, tenant, doc_key)")) == [("route", "big", 1), ("tone", "small", 1)]
