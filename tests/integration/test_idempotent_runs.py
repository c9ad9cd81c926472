"""The promise on the embedded path and on PostgreSQL: re-runs cost nothing and write nothing,
edits re-run only what they change, duplicates share one call, bad input never stops a run."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from etl import Classify, Extract, Pipeline, label_in, run_pipeline
from etl.testing import FakeLLM, ListSource
from tests.helpers import counts, rows

LABELS = ["invoice", "receipt", "complaint", "question"]


class Amount(BaseModel):
    amount: float = Field(ge=0)
    currency: str


def corpus(n: int = 200, duplicate_share: float = 0.0, seed: int = 7) -> list[dict[str, str]]:
    """``n`` documents over two tenants; ``duplicate_share`` of them repeat an earlier text."""
    rng = random.Random(seed)
    docs: list[dict[str, str]] = []
    for i in range(n):
        if docs and rng.random() < duplicate_share:
            text = rng.choice(docs)["text"]
        else:
            text = f"document {i}: {rng.choice(['pay', 'refund', 'why', 'total'])} {rng.randint(1, 10**6)}"
        docs.append({"id": f"doc-{i:04d}", "tenant": ["acme", "globex"][i % 2], "text": text})
    return docs


def pipeline(source: ListSource | Path, url: str, extract_instructions: str = "Extract the amount.") -> Pipeline:
    return Pipeline(
        "test",
        source,
        [
            Classify(LABELS, "What kind of document is this?", name="kind"),
            Extract(Amount, extract_instructions, when=label_in("kind", "invoice", "receipt")),
        ],
        store=url,
    )


def results_snapshot(url: str) -> list[tuple[Any, ...]]:
    """Results with their JSON output decoded (SQLite returns text, PostgreSQL a dict)."""
    found = rows(url, "SELECT tenant, doc_key, stage, cache_key, output FROM stage_results ORDER BY 1, 2, 3")
    return [(*r[:4], json.loads(r[4]) if isinstance(r[4], str) else r[4]) for r in found]


async def test_second_run_makes_no_call_and_writes_no_row(store_url: str) -> None:
    docs = corpus(200)
    first = FakeLLM()
    stats = await run_pipeline(pipeline(ListSource(docs), store_url), llm=first)
    applies = sum(1 for r in results_snapshot(store_url) if r[2] == "kind" and r[4]["label"] in ("invoice", "receipt"))
    assert stats.messages == 200 and stats.dead_letters == 0
    assert len(first.calls) == stats.llm_calls == 200 + applies
    assert 0 < applies < 200
    before, snapshot = counts(store_url), results_snapshot(store_url)
    assert before["stage_results"] == 200 + applies
    assert before["source_positions"] == 1

    second = FakeLLM()
    stats = await run_pipeline(pipeline(ListSource(docs), store_url), llm=second)
    assert len(second.calls) == 0 and stats.llm_calls == 0
    assert stats.hit_rate == 1.0 and stats.results_written == 0
    assert counts(store_url) == before
    assert results_snapshot(store_url) == snapshot


async def test_editing_one_stage_reruns_that_stage_only(sqlite_url: str) -> None:
    docs = corpus(120)
    await run_pipeline(pipeline(ListSource(docs), sqlite_url), llm=FakeLLM())
    applies = rows(sqlite_url, "SELECT count(*) FROM stage_results WHERE stage = 'amount'")[0][0]
    llm = FakeLLM()
    stats = await run_pipeline(pipeline(ListSource(docs), sqlite_url, "Extract the total amount paid."), llm=llm)
    assert len(llm.calls) == applies
    assert all("total amount paid" in call.messages[0]["content"] for call in llm.calls)
    assert stats.results_written == applies
    # The rows were replaced, not duplicated.
    assert rows(sqlite_url, "SELECT count(*) FROM stage_results WHERE stage = 'amount'")[0][0] == applies
    assert rows(sqlite_url, "SELECT count(*) FROM amount")[0][0] == applies


async def test_duplicate_contents_share_one_call_per_tenant(store_url: str) -> None:
    docs = corpus(300, duplicate_share=0.5)
    unique = {(d["tenant"], d["text"]) for d in docs}
    llm = FakeLLM(latency_s=0.002)
    stats = await run_pipeline(pipeline(ListSource(docs), store_url), llm=llm)
    classify_calls = [c for c in llm.calls if "What kind" in c.messages[0]["content"]]
    assert len(classify_calls) == len(unique)  # one call per unique (tenant, content), never two
    assert counts(store_url)["stage_results"] == stats.stage_runs  # but one result per document
    hits = rows(store_url, "SELECT count(*) FROM llm_calls WHERE outcome = 'cache_hit'")[0][0]
    assert hits == stats.cache_hits > 0


async def test_a_tenant_never_receives_another_tenants_cached_output(store_url: str) -> None:
    """Same content, two tenants: two calls, two cache entries, each tenant its own answer."""
    first = [{"id": "a", "tenant": "acme", "text": "same"}]
    await run_pipeline(Pipeline("t", ListSource(first), [Classify(LABELS)], store=store_url),
                       llm=FakeLLM(answer=lambda r: {"label": "invoice"}))
    llm = FakeLLM(answer=lambda r: {"label": "receipt"})
    second = [{"id": "b", "tenant": "globex", "text": "same"}, {"id": "c", "tenant": "acme", "text": "same"}]
    await run_pipeline(Pipeline("t", ListSource(second), [Classify(LABELS)], store=store_url), llm=llm)
    assert len(llm.calls) == 1  # globex asked the model; acme's second document used acme's cache
    labels = results_snapshot(store_url)
    assert [(t, k, out["label"]) for t, k, _, _, out in labels] == [
        ("acme", "a", "invoice"), ("acme", "c", "invoice"), ("globex", "b", "receipt")]
    assert rows(store_url, "SELECT tenant, count(*) FROM llm_cache GROUP BY tenant ORDER BY tenant") == [
        ("acme", 1), ("globex", 1)]


async def test_redelivery_within_one_run_is_a_no_op(sqlite_url: str) -> None:
    doc = {"id": "x", "text": "document repeated by an at-least-once source"}
    llm = FakeLLM(latency_s=0.01)
    stats = await run_pipeline(Pipeline("t", ListSource([doc] * 5), [Classify(LABELS)], store=sqlite_url), llm=llm)
    assert len(llm.calls) == 1 and stats.messages == 5
    assert counts(sqlite_url)["stage_results"] == 1
    assert counts(sqlite_url)["llm_calls"] == 1  # the repeats are not cache hits of a new document


class Joining(ListSource):
    """An endless source that holds nothing to read for its first second, as a Kafka member does
    while it joins its group or waits for the topic's metadata."""

    def __init__(self, items: list[dict[str, str]]) -> None:
        super().__init__(items)
        self.ready_at = 0.0

    def open(self, ledger: Any = None) -> None:
        self.ready_at = time.monotonic() + 1.0

    def reading(self) -> bool:
        return time.monotonic() >= self.ready_at

    def poll(self, max_records: int, timeout_s: float) -> list[Any] | None:
        if not self.reading():
            time.sleep(min(timeout_s, 0.05))
            return []
        return super().poll(max_records, timeout_s) or []  # never ends by itself


async def test_stop_when_idle_counts_only_while_the_source_can_be_read(sqlite_url: str) -> None:
    """Found in CI: a consumer that took longer than the idle time to join stopped with 0 messages."""
    docs = corpus(20)
    stats = await run_pipeline(Pipeline("t", Joining(docs), [Classify(LABELS)], store=sqlite_url),
                               llm=FakeLLM(), idle_stop_s=0.3)
    assert stats.messages == 20 and counts(sqlite_url)["stage_results"] == 20


async def test_bad_lines_become_dead_letters_and_the_run_goes_on(tmp_path: Path, sqlite_url: str) -> None:
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"id": "1", "text": "good one"}\n{bad json\n\xff\xfe\n{"id": "2"}\n{"id": "3", "text": "good two"}\n')
    p = Pipeline("t", f, [Classify(LABELS)], store=sqlite_url)
    stats = await run_pipeline(p, llm=FakeLLM())
    assert stats.messages == 5 and stats.dead_letters == 3 and stats.results_written == 2
    letters = rows(sqlite_url, "SELECT message_offset, reason, detail, payload FROM dead_letters ORDER BY 1")
    assert [(o, r) for o, r, _, _ in letters] == [(1, "bad_input"), (2, "bad_input"), (3, "bad_input")]
    assert bytes(letters[1][3]) == b"\xff\xfe"  # original bytes kept
    assert "JSON" in letters[0][2] and "UTF-8" in letters[1][2] and "'text'" in letters[2][2]
    before = counts(sqlite_url)
    again = await run_pipeline(Pipeline("t", f, [Classify(LABELS)], store=sqlite_url), llm=FakeLLM())
    assert again.llm_calls == 0 and counts(sqlite_url) == before
    # in == results + dead letters
    assert stats.messages == before["documents"] + before["dead_letters"]


async def test_terminal_model_failure_is_a_dead_letter_and_not_retried_on_redelivery(sqlite_url: str) -> None:
    docs = [{"id": "1", "text": "fine"}, {"id": "2", "text": "model answers nonsense"}]
    llm = FakeLLM(answer=lambda r: "nonsense" if "nonsense" in r.messages[1]["content"] else {"label": "invoice"})
    stats = await run_pipeline(Pipeline("t", ListSource(docs), [Classify(LABELS)], store=sqlite_url), llm=llm)
    assert stats.dead_letters == 1 and stats.results_written == 1
    assert rows(sqlite_url, "SELECT doc_key, reason, raw_output FROM dead_letters") == [("2", "schema_invalid", "nonsense")]
    # the invalid answer was shown back to the model once (a repair), then the stage gave up
    assert rows(sqlite_url, "SELECT outcome, error FROM llm_calls WHERE doc_key = '2' ORDER BY id") == [
        ("repair", "schema_invalid"), ("failed", "schema_invalid")]
    assert "That answer is invalid" in llm.calls[-1].messages[-1]["content"]
    assert rows(sqlite_url, "SELECT count(*) FROM llm_cache")[0][0] == 1  # only validated outputs are cached
    again = FakeLLM(answer=llm.answer)
    await run_pipeline(Pipeline("t", ListSource(docs), [Classify(LABELS)], store=sqlite_url), llm=again)
    assert again.calls == []


async def test_transient_failures_are_retried_and_every_attempt_recorded(sqlite_url: str) -> None:
    from etl import TransientLLMError

    llm = FakeLLM(fault=lambda r, n: TransientLLMError("429") if n < 2 else None)
    p = Pipeline("t", ListSource([{"id": "1", "text": "hello"}]), [Classify(LABELS)], store=sqlite_url)
    stats = await run_pipeline(p, llm=llm)
    assert stats.results_written == 1 and len(llm.calls) == 3
    assert rows(sqlite_url, "SELECT outcome FROM llm_calls ORDER BY id") == [("retry",), ("retry",), ("ok",)]
    assert rows(sqlite_url, "SELECT attempts FROM stage_results") == [(3,)]


@pytest.mark.parametrize("in_flight", [1, 64])
async def test_results_do_not_depend_on_concurrency(in_flight: int, sqlite_url: str) -> None:
    from etl.runtime.wiring import build_runner
    from etl.settings import Settings

    docs = corpus(150, duplicate_share=0.3)
    runner = build_runner(pipeline(ListSource(docs), sqlite_url), Settings(max_in_flight=in_flight, flush_size=17),
                          llm=FakeLLM(latency_s=lambda: random.random() / 500))
    await runner.run()
    assert rows(sqlite_url, "SELECT count(DISTINCT doc_key) FROM stage_results WHERE stage = 'kind'")[0][0] == 150
    assert rows(sqlite_url, "SELECT next_offset FROM source_positions") == [(150,)]


async def test_without_when_redeliveries_are_settled_in_the_store(store_url: str) -> None:
    """A pipeline without when= asks the store which documents are not settled (on PostgreSQL the
    database compares the keys and returns only those): a second run is free, a quarantined
    document stays a no-op, an edited text is new work."""
    from connectors.store import SqlStore, Store  # noqa: PLC0415
    from etl.testing import schema_answer  # noqa: PLC0415

    docs = [*corpus(40), {"id": "poison", "tenant": "acme", "text": "poison pill"}]

    def answer(request: Any) -> Any:
        return "no json here" if "poison" in json.dumps(request.messages) else schema_answer(request)

    def flat(items: list[dict[str, str]]) -> Pipeline:
        return Pipeline("flat", ListSource(items), [Classify(LABELS, "What kind?", name="kind")], store=store_url)

    first = await run_pipeline(flat(docs), llm=FakeLLM(answer))
    assert (first.results_written, first.dead_letters) == (40, 1)
    before = counts(store_url)
    again = FakeLLM(answer)
    stats = await run_pipeline(flat(docs), llm=again)
    assert again.calls == [] and counts(store_url) == before and stats.stored_hits == 41

    store = SqlStore(store_url)
    (tenant, key, stage, cache_key), *_ = rows(store_url, "SELECT tenant, doc_key, stage, cache_key FROM stage_results "
                                                          "WHERE doc_key = 'doc-0003'")
    poison_key = rows(store_url, "SELECT cache_key FROM dead_letters")[0][0]
    expected = [
        (tenant, key, stage, cache_key),            # stored for exactly this key: settled
        ("acme", key, stage, cache_key),            # the same key under another tenant: not stored
        (tenant, "doc-0005", stage, cache_key),     # another document's key: not this content
        (tenant, "nobody", stage, cache_key),       # never seen
        ("acme", "poison", stage, poison_key),      # an open dead letter
    ]
    assert tenant != "acme"
    (stream, partition, offset), = rows(store_url, "SELECT stream, partition, message_offset FROM documents "
                                                   f"WHERE doc_key = '{key}'")
    at = {(t, k): (stream, partition, offset) for t, k, _, _ in expected}
    unsettled = {("acme", key), (tenant, "doc-0005"), (tenant, "nobody"), ("acme", "poison")}
    assert store.unsettled("flat", expected, at) == Store.unsettled(store, "flat", expected, at) == unsettled
    # The same content at a newer position is a new version, not a redelivery.
    newer = {**at, (tenant, key): (stream, partition, offset + 1000)}
    assert store.unsettled("flat", expected, newer) == Store.unsettled(store, "flat", expected, newer) == {
        *unsettled, (tenant, key)}

    edited = [dict(d, text=d["text"] + " (edited)") if d["id"] in ("doc-0001", "doc-0002") else d for d in docs]
    third = FakeLLM(answer)
    await run_pipeline(flat(edited), llm=third)
    assert len(third.calls) == 2


async def test_a_cached_key_is_never_claimed(store_url: str) -> None:
    """Whoever asks to claim a key whose output is already stored must read the cache instead: the
    claim is refused and leaves no row behind (it would block other workers for a whole lease)."""
    from connectors.store import SqlStore  # noqa: PLC0415

    await run_pipeline(Pipeline("c", ListSource(corpus(3)), [Classify(LABELS, name="kind")], store=store_url),
                       llm=FakeLLM())
    cached = [key for (key,) in rows(store_url, "SELECT cache_key FROM llm_cache")]
    store = SqlStore(store_url)
    assert store.claim_many([*cached, "f" * 64], "worker-a", 30) == {**dict.fromkeys(cached, "held"), "f" * 64: "mine"}
    assert rows(store_url, "SELECT cache_key, owner FROM llm_claims") == [("f" * 64, "worker-a")]
