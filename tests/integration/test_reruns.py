"""Re-runs over documents that ended as dead letters: what a later stage's known failure must not
cost (issue 26). Every way a document can finish a run must store what was paid for, record the
call and release its claim; the next run then costs nothing and waits for nothing."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from etl import Classify, Extract, Pipeline, label_in, run_pipeline
from etl.llm.base import LLMRequest
from etl.testing import FakeLLM, ListSource, schema_answer
from tests.helpers import counts, rows

LABELS = ["invoice", "receipt", "complaint", "question"]
DOCS = [{"id": "doc-1", "tenant": "acme", "text": "Invoice 17: 42.50 EUR, due in 30 days."}]


class Amount(BaseModel):
    amount: float = Field(ge=0)
    currency: str


def prose_for_extract(request: LLMRequest) -> str | dict[str, Any]:
    """Answers Classify; answers every Extract request (and its repair) with prose."""
    if "label" in request.json_schema.get("properties", {}):
        return schema_answer(request)
    return "The amount is forty-two euros and fifty cents, I believe."


def two_stages(url: str, instructions: str, **extract: Any) -> Pipeline:
    return Pipeline("reruns", ListSource(DOCS), [
        Classify(LABELS, instructions, name="intent"),
        Extract(Amount, "Extract the amount.", **extract),
    ], store=url)


def claims(url: str) -> int:
    return rows(url, "SELECT count(*) FROM llm_claims WHERE failure IS NULL")[0][0]  # type: ignore[no-any-return]


async def test_a_prompt_change_under_a_dead_later_stage_is_paid_once_and_stored(store_url: str) -> None:
    """The issue's table: run 0 (v1), then three runs with the Classify instructions edited (v2)."""
    table = []
    for run, instructions in enumerate(["Which intent? v1", "Which intent? v2", "Which intent? v2",
                                        "Which intent? v2"]):
        llm = FakeLLM(prose_for_extract)
        started = time.perf_counter()
        stats = await run_pipeline(two_stages(store_url, instructions), llm=llm)
        elapsed = time.perf_counter() - started
        intent = rows(store_url, "SELECT prompt_hash FROM stage_results WHERE stage = 'intent'")
        table.append((run, len(llm.calls), stats.llm_calls, stats.results_written, len(intent),
                      counts(store_url)["llm_calls"], claims(store_url), round(elapsed, 1)))
        if run == 0:
            v1 = intent
        if run == 1:
            v2 = intent
    print("\nrun, model calls, counted, results written, intent rows, llm_calls rows, open claims, seconds")
    for line in table:
        print(line)
    assert table[0][1:7] == (3, 3, 1, 1, 3, 0)  # Classify, then Extract and its repair: a dead letter
    # The v2 answer is paid once, stored and recorded; the Extract letter stays open.
    assert table[1][1:7] == (1, 1, 1, 1, 4, 0)
    assert v2 != v1
    # Then nothing: no call, no row, no claim to wait out.
    for run in (2, 3):
        assert table[run][1:7] == (0, 0, 0, 1, 4, 0)
    assert rows(store_url, "SELECT stage, reason, status FROM dead_letters") == [("amount", "schema_invalid", "open")]
    assert rows(store_url, "SELECT stage, outcome FROM llm_calls ORDER BY id")[-1] == ("intent", "ok")


async def test_a_fresh_stage_before_a_budget_quarantine_is_stored_and_released(store_url: str) -> None:
    """The budget's quarantine is the later stage's dead letter: the earlier stage's fresh answer
    is stored with it and its claim released."""
    pipeline = Pipeline("reruns", ListSource(DOCS), [
        Classify(LABELS, "Which intent?", name="intent"),
        Extract(Amount, "Extract the amount."),
    ], store=store_url, budgets={"acme": 100})
    llm = FakeLLM(tokens=(80, 20))
    stats = await run_pipeline(pipeline, llm=llm)
    assert len(llm.calls) == stats.llm_calls == 1
    assert rows(store_url, "SELECT stage FROM stage_results") == [("intent",)]
    assert rows(store_url, "SELECT stage, reason FROM dead_letters") == [("amount", "budget_exceeded")]
    assert claims(store_url) == 0
    again = FakeLLM(tokens=(80, 20))
    stats = await run_pipeline(pipeline, llm=again)
    assert len(again.calls) == stats.llm_calls == stats.results_written == 0
    assert claims(store_url) == 0


async def test_a_stage_skipped_by_when_after_a_prompt_change_is_stored(store_url: str) -> None:
    """A changed first stage whose new answer skips the dead later stage: the letter resolves, the
    answer is stored, and the next run costs nothing."""
    def always_prose(request: LLMRequest) -> str | dict[str, Any]:
        if "label" in request.json_schema.get("properties", {}):
            return {"label": "invoice" if "v1" in str(request.messages) else "question"}
        return "no JSON here"

    def pipeline(version: str) -> Pipeline:
        return two_stages(store_url, f"Which intent? {version}", when=label_in("intent", "invoice"))

    await run_pipeline(pipeline("v1"), llm=FakeLLM(always_prose))
    assert rows(store_url, "SELECT status FROM dead_letters") == [("open",)]
    llm = FakeLLM(always_prose)
    stats = await run_pipeline(pipeline("v2"), llm=llm)
    assert len(llm.calls) == stats.llm_calls == 1 and stats.results_written == 1
    assert rows(store_url, "SELECT status FROM dead_letters") == [("replayed",)]
    again = FakeLLM(always_prose)
    stats = await run_pipeline(pipeline("v2"), llm=again)
    assert len(again.calls) == stats.llm_calls == stats.results_written == 0
    assert claims(store_url) == 0
