"""The promise under hostile data (issue 10, cases 1–8): odd messages, odd answers, edited
documents and concurrent versions, on the embedded store and on real PostgreSQL.

Each test names the case it pins; each failed on the code before the fix."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, field_validator
from sqlalchemy import create_engine, inspect

from connectors.sources import Message, Source
from connectors.sources.dead_letters import DeadLetterSource
from connectors.store import Batch, DocumentOutcome, SqlStore, make_engine
from dedup import content_hash
from etl import Classify, Decoder, Extract, Pipeline, Settings, Truncated, label_in, non_negative, run_pipeline
from etl.runtime.execute import StagePlan
from etl.llm.base import LLMRequest, LLMResponse
from etl.runtime.wiring import build_runner
from etl.testing import FakeLLM, ListSource
from etl.validators import Check, date_parses
from schemas import CallRecord, DeadLetter, Position
from tests.helpers import counts, rows

LABELS = ["a", "b", "c"]


class Amount(BaseModel):
    amount: float
    count: int


def text_of(request: LLMRequest) -> str:
    return request.messages[1]["content"]


def labelled(label_for: dict[str, str], default: str = "b") -> Any:
    """Classify answers by text (``{text: label}``); Extract answers with a valid amount."""

    def answer(request: LLMRequest) -> Any:
        if "label" in request.json_schema.get("properties", {}):
            return {"label": label_for.get(text_of(request), default)}
        return {"amount": 1.5, "count": 2}

    return answer


def two_stage(source: Source | Path, url: str, instructions: str = "Pick.", decoder: Decoder | None = None) -> Pipeline:
    return Pipeline("hostile", source, [
        Classify(LABELS, instructions, name="kind"),
        Extract(Amount, "Extract.", when=label_in("kind", "a")),
    ], store=url, decoder=decoder)


def state(url: str) -> dict[str, Any]:
    """Per document: stored content hash and offset, stages stored, typed row present, open letters."""
    docs = {k: (h, o) for k, h, o in rows(url, "SELECT doc_key, content_hash, message_offset FROM documents")}
    stages: dict[str, set[str]] = {}
    for key, stage in rows(url, "SELECT doc_key, stage FROM stage_results"):
        stages.setdefault(key, set()).add(stage)
    has_typed = "amount" in inspect(create_engine(url)).get_table_names()
    typed = {k for (k,) in rows(url, "SELECT doc_key FROM amount")} if has_typed else set()
    letters = rows(url, "SELECT doc_key, message_offset, status, reason FROM dead_letters ORDER BY message_offset")
    return {"docs": docs, "stages": stages, "typed": typed, "letters": letters}


# -- case 1: one bad message never stops a run ------------------------------------------------------

POISON = [
    b'{"id": "s1", "text": "lone \\ud800 surrogate"}',
    b'{"id": "\\udfff", "text": "surrogate id"}',
    b'{"id": "s3", "tenant": "ac\\ud800me", "text": "surrogate tenant"}',
    b"[" * 4000,  # under max_bytes, deeper than the JSON decoder recurses
    b'{"id": "n1", "text": "nul \\u0000 in text"}',
    b'{"id": "n\\u0000", "text": "nul in id"}',
    b'{"id": "n3", "tenant": "a\\u0000", "text": "nul in tenant"}',
    json.dumps({"id": "t1", "tenant": "t" * 201, "text": "long tenant"}).encode(),
    json.dumps({"id": "k" * 501, "text": "long key"}).encode(),
    b'{"id": 1, "text": "integer id"}',
    b'{"id": "x", "tenant": 7, "text": "integer tenant"}',
    json.dumps({"id": "big", "text": "x" * 5000}).encode(),
]


async def test_case1_poison_messages_become_dead_letters_and_the_run_ends(store_url: str) -> None:
    items: list[bytes] = []
    for i, poison in enumerate(POISON):
        items += [json.dumps({"id": f"g{i}", "text": f"good {i}"}).encode(), poison]
    items.append(b'{"id": "1", "text": "the string id 1"}')
    llm = FakeLLM(labelled({}))
    p = two_stage(ListSource(items), store_url, decoder=Decoder(max_bytes=4096))
    stats = await run_pipeline(p, llm=llm)
    assert stats.messages == len(items) and stats.dead_letters == len(POISON)
    letters = rows(store_url, "SELECT message_offset, reason, detail, payload FROM dead_letters ORDER BY 1")
    assert [o for o, *_ in letters] == [2 * i + 1 for i in range(len(POISON))]
    assert {r for _, r, _, _ in letters} == {"bad_input"}
    assert [bytes(p) for *_, p in letters] == POISON  # original bytes kept
    for fragment, (_, _, detail, _) in zip(
            ["surrogate", "surrogate", "surrogate", "nested", "NUL", "NUL", "NUL", "200", "500", "string", "string",
             "byte"], letters, strict=True):
        assert fragment.lower() in detail.lower(), detail
    assert rows(store_url, "SELECT next_offset FROM source_positions") == [(len(items),)]
    assert counts(store_url)["documents"] == len(POISON) + 1  # every good one, "1" among them
    before = counts(store_url)
    again = FakeLLM(labelled({}))
    await run_pipeline(two_stage(ListSource(items), store_url, decoder=Decoder(max_bytes=4096)), llm=again)
    assert again.calls == [] and counts(store_url) == before


def test_case7_integer_keys_are_typed_not_collapsed() -> None:
    decoder = Decoder(key_type="int")
    read = decoder.read(Message(value=b'{"id": 1, "text": "t"}', stream="s", offset=0), "json")
    assert read.key == "1"
    with pytest.raises(Exception, match="integer"):
        decoder.read(Message(value=b'{"id": "1", "text": "t"}', stream="s", offset=1), "json")


# -- case 2: answers that pass pydantic but would break the store -----------------------------------

BAD_ANSWERS = {
    "nan confidence": '{"label": "a", "confidence": NaN}',
    "huge count": '{"amount": 1.0, "count": 1180591620717411303424}',
    "infinite amount": '{"amount": Infinity, "count": 1}',
    "nan amount": '{"amount": NaN, "count": 1}',
    "nul label": '{"label": "a\\u0000"}',
}


async def test_case2_answers_the_store_would_reject_are_dead_letters(store_url: str) -> None:
    def answer(request: LLMRequest) -> Any:
        text = text_of(request)
        if "label" in request.json_schema.get("properties", {}):
            return BAD_ANSWERS[text] if text in ("nan confidence", "nul label") else {"label": "a"}
        return BAD_ANSWERS.get(text, {"amount": 2.0, "count": 3})

    docs = [{"id": k.replace(" ", "-"), "text": k} for k in [*BAD_ANSWERS, "fine"]]
    stats = await run_pipeline(two_stage(ListSource(docs), store_url), llm=FakeLLM(answer))
    assert stats.messages == 6 and stats.dead_letters == 5
    letters = dict(rows(store_url, "SELECT doc_key, reason FROM dead_letters"))
    assert letters == {d["id"]: "schema_invalid" for d in docs if d["text"] != "fine"}
    outputs = [o if isinstance(o, str) else json.dumps(o) for (o,) in rows(store_url, "SELECT output FROM stage_results")]
    assert all("NaN" not in o and "Infinity" not in o for o in outputs)
    assert state(store_url)["stages"]["fine"] == {"kind", "amount"}
    assert state(store_url)["stages"]["huge-count"] == {"kind"}  # the earlier stage's paid work is kept


class Priced(BaseModel):
    price: Decimal


class LongModelName(FakeLLM):
    """A provider that reports a model name longer than the store's column."""

    async def generate(self, request: LLMRequest) -> LLMResponse:
        response = await super().generate(request)
        return LLMResponse(text=response.text, model="m" * 400, tokens_in=1, tokens_out=1)


async def test_case2_a_document_the_store_refuses_is_quarantined_alone(postgres_url: str) -> None:
    """A finite Decimal PostgreSQL's numeric cannot hold passes every check: the store refuses that
    document's row, and only it is quarantined (store_rejected), with its attempts kept."""
    docs = [{"id": f"d{i}", "text": "reject me" if i == 3 else f"fine {i}"} for i in range(8)]

    def answer(request: LLMRequest) -> Any:
        return '{"price": "1E+200000"}' if "reject me" in text_of(request) else {"price": "2.50"}

    p = Pipeline("alone", ListSource(docs), [Extract(Priced, "Price.")], store=postgres_url)
    stats = await run_pipeline(p, llm=LongModelName(answer))
    assert stats.messages == 8
    assert rows(postgres_url, "SELECT doc_key, reason FROM dead_letters") == [("d3", "store_rejected")]
    assert counts(postgres_url)["stage_results"] == 7 and counts(postgres_url, ("priced",))["priced"] == 7
    assert rows(postgres_url, "SELECT count(*) FROM llm_calls WHERE doc_key = 'd3'") == [(1,)]  # paid work kept
    assert {len(m) for (m,) in rows(postgres_url, "SELECT DISTINCT model FROM llm_calls")} == {300}
    assert rows(postgres_url, "SELECT next_offset FROM source_positions") == [(8,)]
    again = LongModelName(answer)
    await run_pipeline(Pipeline("alone", ListSource(docs), p.stages, store=postgres_url), llm=again)
    assert again.calls == []


# -- case 3: versions -------------------------------------------------------------------------------

async def test_case3_two_versions_in_flight_the_newest_wins_whatever_finishes_last(store_url: str) -> None:
    docs = [{"id": "k", "text": "old slow"}, {"id": "k", "text": "new fast"}]
    llm = FakeLLM(labelled({}), latency_s=0.0)
    slow = FakeLLM(labelled({}))

    async def generate(request: LLMRequest) -> LLMResponse:
        await asyncio.sleep(0.3 if "slow" in text_of(request) else 0.0)
        return await FakeLLM.generate(slow, request)

    llm.generate = generate  # type: ignore[method-assign]
    from etl.settings import Settings  # noqa: PLC0415

    runner = build_runner(Pipeline("v", ListSource(docs), [Classify(LABELS, "Pick.", name="kind")], store=store_url),
                          Settings(flush_interval_s=0.05), llm=llm)
    await runner.run()
    assert state(store_url)["docs"] == {"k": (content_hash("new fast"), 1)}
    assert rows(store_url, "SELECT count(*) FROM stage_results")[0][0] == 1


async def test_case3_a_key_twice_in_a_file_is_stable_across_re_runs(tmp_path: Path, store_url: str) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text('{"id": "k", "text": "first"}\n{"id": "j", "text": "other"}\n{"id": "k", "text": "second"}\n')
    await run_pipeline(two_stage(f, store_url), llm=FakeLLM(labelled({"second": "a"})))
    first = state(store_url)
    assert first["docs"]["k"] == (content_hash("second"), 2) and first["stages"]["k"] == {"kind", "amount"}
    before = counts(store_url, (*counts(store_url), "amount"))
    for _ in range(2):
        again = FakeLLM(labelled({"second": "a"}))
        await run_pipeline(two_stage(f, store_url), llm=again)
        assert again.calls == [] and counts(store_url, tuple(before)) == before and state(store_url) == first


class TwoPartitions(Source):
    """One stream, two partitions, each message given as (partition, offset, value)."""

    def __init__(self, messages: list[tuple[int, int, bytes]]) -> None:
        self.messages = messages
        self.name = "two"
        self._served = False

    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        if self._served:
            return None
        self._served = True
        return [Message(value=v, stream="two", partition=p, offset=o) for p, o, v in self.messages]


async def test_case3_versions_in_two_partitions_do_not_flip_on_replays(store_url: str) -> None:
    messages = [(1, 0, b'{"id": "k", "text": "in partition one"}'), (0, 5, b'{"id": "k", "text": "in partition zero"}')]
    for _ in range(3):
        llm = FakeLLM(labelled({}))
        await run_pipeline(Pipeline("p", TwoPartitions(messages), [Classify(LABELS, name="kind")], store=store_url),
                           llm=llm)
        # (stream, partition, offset) order: partition 1 is the newer version, whatever the order read
        assert state(store_url)["docs"] == {"k": (content_hash("in partition one"), 0)}
        messages.reverse()
    assert rows(store_url, "SELECT count(*) FROM llm_calls WHERE outcome = 'cache_hit'")[0][0] == 0


async def test_case3_dlq_replay_of_an_old_version_never_overwrites_the_new_one(store_url: str) -> None:
    docs = [{"id": "k", "text": "old breaks"}, {"id": "k", "text": "new is fine"}]

    def answer(request: LLMRequest) -> Any:
        return "not json" if "breaks" in text_of(request) else {"label": "b"}

    # The old version fails first (its own run), the new one succeeds later.
    await run_pipeline(Pipeline("d", ListSource(docs[:1]), [Classify(LABELS, name="kind")], store=store_url),
                       llm=FakeLLM(answer))
    await run_pipeline(Pipeline("d", ListSource(docs), [Classify(LABELS, name="kind")], store=store_url),
                       llm=FakeLLM(answer))
    assert state(store_url)["letters"] == [("k", 0, "superseded", "schema_invalid")]
    p = Pipeline("d", ListSource(docs), [Classify(LABELS, name="kind")], store=store_url)
    p.source = DeadLetterSource(make_engine(store_url), "d", reason=None)
    runner = build_runner(p, llm=FakeLLM(labelled({})), replaying_dead_letters=True)
    await runner.run()  # nothing open: nothing replayed
    assert state(store_url)["docs"] == {"k": (content_hash("new is fine"), 1)}


# -- case 4: results that no longer apply go ---------------------------------------------------------

async def test_case4_a_changed_label_removes_the_extract_result_and_typed_row(store_url: str) -> None:
    docs = [{"id": "k", "text": "t"}]
    await run_pipeline(two_stage(ListSource(docs), store_url), llm=FakeLLM(labelled({"t": "a"})))
    assert state(store_url)["stages"] == {"k": {"kind", "amount"}} and state(store_url)["typed"] == {"k"}
    await run_pipeline(two_stage(ListSource(docs), store_url, "Pick again."), llm=FakeLLM(labelled({"t": "b"})))
    assert state(store_url)["stages"] == {"k": {"kind"}} and state(store_url)["typed"] == set()
    again = FakeLLM(labelled({"t": "b"}))
    await run_pipeline(two_stage(ListSource(docs), store_url, "Pick again."), llm=again)
    assert again.calls == []


# -- case 5: a quarantined later stage keeps the earlier stage's paid work --------------------------

async def test_case5_a_failed_later_stage_keeps_results_attempts_and_releases_claims(store_url: str) -> None:
    def answer(request: LLMRequest) -> Any:
        if "label" in request.json_schema.get("properties", {}):
            return {"label": "a"}
        return '{"amount": NaN, "count": 1}' if "nan" in text_of(request) else "prose, no json"

    docs = [{"id": "k", "text": "t"}, {"id": "n", "text": "nan"}]
    stats = await run_pipeline(two_stage(ListSource(docs), store_url), llm=FakeLLM(answer, price_per_mtok=(1.0, 1.0)))
    assert stats.dead_letters == 2
    assert state(store_url)["stages"] == {"k": {"kind"}, "n": {"kind"}}
    assert rows(store_url, "SELECT doc_key, stage, outcome FROM llm_calls ORDER BY doc_key, id") == [
        ("k", "kind", "ok"), ("k", "amount", "repair"), ("k", "amount", "failed"),
        ("n", "kind", "ok"), ("n", "amount", "repair"), ("n", "amount", "failed")]
    # No claim blocks anyone: the failed keys' claims carry their reason, for workers that were
    # waiting on them (until the lease ends); any other claimer takes them at once.
    assert sorted(rows(store_url, "SELECT failure FROM llm_claims")) == [("schema_invalid",), ("schema_invalid",)]
    assert rows(store_url, "SELECT round(CAST(sum(cost) AS numeric), 6) FROM llm_calls")[0][0] > 0
    again = FakeLLM(answer)
    await run_pipeline(two_stage(ListSource(docs), store_url), llm=again)
    assert again.calls == []


# -- case 6: dead letters per version, resolved exactly once ------------------------------------------

async def test_case6_a_success_resolves_only_its_own_version_and_bad_input_is_resolvable(store_url: str) -> None:
    docs = [{"id": "k", "text": "v1 breaks"}, {"id": "k", "text": "v2 breaks"}, {"id": "big", "text": "y" * 300}]
    broken = FakeLLM(lambda r: "not json" if "breaks" in text_of(r) else {"label": "b"})
    p = Pipeline("l", ListSource(docs), [Classify(LABELS, name="kind")], store=store_url, decoder=Decoder(max_bytes=200))
    await run_pipeline(p, llm=broken)
    assert state(store_url)["letters"] == [("k", 0, "superseded", "schema_invalid"), ("k", 1, "open", "schema_invalid"),
                                           (None, 2, "open", "bad_input")]
    fixed = Pipeline("l", ListSource(docs), [Classify(LABELS, name="kind")], store=store_url,
                     decoder=Decoder(max_bytes=10_000))
    fixed.source = DeadLetterSource(make_engine(store_url), "l")
    await build_runner(fixed, llm=FakeLLM(labelled({})), replaying_dead_letters=True).run()
    assert state(store_url)["letters"] == [("k", 0, "superseded", "schema_invalid"), ("k", 1, "replayed", "schema_invalid"),
                                           (None, 2, "replayed", "bad_input")]
    assert state(store_url)["docs"] == {"k": (content_hash("v2 breaks"), 1), "big": (content_hash("y" * 300), 2)}


def test_case6_dead_letters_are_published_once_after_the_commit(store_url: str) -> None:
    store = SqlStore(store_url)
    store.prepare([])
    letter = DeadLetter(position=Position(stream="s", offset=3), reason="bad_input", detail="d", payload=b"\x00raw")
    batch = Batch(outcomes=[DocumentOutcome(document=None, dead_letter=letter)], positions={("s", 0): 4}, outbox=True)
    store.write("o", batch)
    store.write("o", batch)  # a commit retried after a lost acknowledgement
    published: list[list[DeadLetter]] = []
    assert store.publish_pending("o", published.append) == 1
    assert store.publish_pending("o", published.append) == 0  # a restart publishes nothing again
    assert [[(d.position.offset, d.payload) for d in batch] for batch in published] == [[(3, b"\x00raw")]]

    def refused(_: list[DeadLetter]) -> None:
        raise RuntimeError("broker away")

    store.write("o", Batch(outcomes=[DocumentOutcome(document=None, dead_letter=letter.model_copy(
        update={"position": Position(stream="s", offset=9)}))], outbox=True))
    with pytest.raises(RuntimeError):
        store.publish_pending("o", refused)
    assert store.publish_pending("o", published.append) == 1  # still pending after a failed publish


# -- case 7: idempotent writes ------------------------------------------------------------------------

def test_case7_a_retried_commit_adds_no_attempt_row(store_url: str) -> None:
    store = SqlStore(store_url)
    store.prepare([])
    call = CallRecord(tenant="t", stage="s", doc_key="k", cache_key="c" * 64, model="m", outcome="failed",
                      tokens_in=1, tokens_out=1, cost=0.5, latency_ms=1.0)
    letter = DeadLetter(position=Position(stream="s", offset=0), reason="schema_invalid", detail="d", payload=b"x")
    batch = Batch(outcomes=[DocumentOutcome(document=None, calls=(call, call), dead_letter=letter)])
    store.write("w", batch)
    store.write("w", batch)
    assert rows(store_url, "SELECT count(*), sum(cost) FROM llm_calls") == [(1, 0.5)]


# -- case 8: complete fingerprints --------------------------------------------------------------------

def fingerprint(stage: Classify | Extract, repairs: int = 1) -> str:
    return StagePlan.of(stage, FakeLLM(), repairs).fingerprint


class Plain(BaseModel):
    amount: float
    count: int


class Checked(BaseModel):
    amount: float
    count: int

    @field_validator("count")
    @classmethod
    def small(cls, value: int) -> int:
        if value > 10:
            raise ValueError("count must be at most 10")
        return value


def test_case8_fingerprints_cover_validator_parameters_code_model_checks_and_repairs() -> None:
    base = Extract(Plain, "x", validators=[date_parses("amount")])
    assert fingerprint(base) != fingerprint(Extract(Plain, "x", validators=[date_parses("amount", ["%Y"])]))
    assert fingerprint(Extract(Plain, "x", validators=[non_negative("amount")])) != fingerprint(
        Extract(Plain, "x", validators=[non_negative("count")]))
    with pytest.warns(UserWarning, match="source code"):
        one = fingerprint(Extract(Plain, "x", validators=[lambda o: None]))
    with pytest.warns(UserWarning, match="source code"):
        two = fingerprint(Extract(Plain, "x", validators=[lambda o: "no" if o.count else None]))  # type: ignore[attr-defined]
    assert one != two
    assert fingerprint(Extract(Plain, "x", table="t")) != fingerprint(Extract(Checked, "x", name="plain", table="t"))
    assert fingerprint(base, repairs=1) != fingerprint(base, repairs=2)
    assert Check("c", lambda o: None, n=1).spec() == {"check": "c", "params": {"n": 1}}


THRESHOLD = {"max": 100}


def below_threshold(output: BaseModel) -> str | None:
    return "too many" if output.count > THRESHOLD["max"] else None  # type: ignore[attr-defined]


async def test_case8_stored_outputs_that_fail_revalidation_never_stop_a_run(store_url: str, recwarn: Any) -> None:
    class Counted(BaseModel):
        amount: float
        count: int

        @field_validator("count")
        @classmethod
        def limit(cls, value: int) -> int:
            if value > THRESHOLD["max"]:
                raise ValueError("count over the limit")
            return value

    def answer(request: LLMRequest) -> Any:
        return {"label": "a"} if "label" in request.json_schema.get("properties", {}) else {"amount": 1.0, "count": 50}

    def build() -> Pipeline:
        return Pipeline("r", ListSource([{"id": "k", "text": "t"}]), [
            Classify(LABELS, "Pick.", name="kind"),
            Extract(Counted, "Extract.", name="amount", when=label_in("kind", "a"), table="counted"),
            Classify(LABELS, "Again.", name="after", when=lambda outputs: "amount" in outputs),
        ], store=store_url)

    await run_pipeline(build(), llm=FakeLLM(answer))
    THRESHOLD["max"] = 10  # the validator now refuses what is stored, with the same code
    try:
        stats = await run_pipeline(build(), llm=FakeLLM(answer))
    finally:
        THRESHOLD["max"] = 100
    assert stats.dead_letters == 1  # asked again, refused again: a dead letter, not a crash
    assert rows(store_url, "SELECT reason FROM dead_letters") == [("schema_invalid",)]


async def test_a_validator_that_raises_is_the_documents_dead_letter(sqlite_url: str) -> None:
    def explodes(output: BaseModel) -> str | None:
        raise KeyError("boom")

    docs = [{"id": "1", "text": "x"}, {"id": "2", "text": "y"}]
    stage = Classify(LABELS, "Pick.", validators=[explodes])
    with pytest.warns(UserWarning, match="source code"):
        stats = await run_pipeline(Pipeline("e", ListSource(docs), [stage], store=sqlite_url), llm=FakeLLM(labelled({})))
    assert stats.dead_letters == 2
    assert {r for (r,) in rows(sqlite_url, "SELECT reason FROM dead_letters")} == {"stage_error"}


async def test_case2_an_answer_holding_a_lone_surrogate_keeps_its_own_reason(store_url: str) -> None:
    """The raw answer is kept as evidence, made storable: the letter stays schema_invalid (found by
    the property test as store_rejected, which dropped the document's paid classification)."""
    def answer(request: LLMRequest) -> Any:
        return '{"label": "a\ud800"}'  # a literal lone surrogate, outside the label set

    stats = await run_pipeline(two_stage(ListSource([{"id": "k", "text": "t"}]), store_url), llm=FakeLLM(answer))
    assert stats.dead_letters == 1
    assert rows(store_url, "SELECT reason FROM dead_letters") == [("schema_invalid",)]
    assert rows(store_url, "SELECT count(*) FROM llm_calls") == [(2,)]  # the answer and its repair


# -- found by review of the version fix: each failed before it -------------------------------------

async def test_a_newer_copy_before_its_stored_position_in_one_batch_is_kept(store_url: str) -> None:
    """Without when= (the redelivery fast path): A stored at (0, 0); then one batch holding A at
    (1, 0) and A at (0, 0) again, and B at (0, 1) after it. A at (1, 0) is the newest version."""
    class Polled(TwoPartitions):
        def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
            batch, self.messages = self.messages[:max_records], self.messages[max_records:]
            return [Message(value=v, stream="two", partition=p, offset=o) for p, o, v in batch] or None

    def flat(messages: list[tuple[int, int, bytes]]) -> Pipeline:
        return Pipeline("p", Polled(messages), [Classify(LABELS, name="kind")], store=store_url)

    a, b = b'{"id": "k", "text": "A"}', b'{"id": "k", "text": "B"}'
    two_per_poll = Settings(max_in_flight=4, flush_size=100, flush_interval_s=0.02)
    await run_pipeline(flat([(0, 0, a)]), two_per_poll, llm=FakeLLM(labelled({})))
    await run_pipeline(flat([(1, 0, a), (0, 0, a), (0, 1, b)]), two_per_poll, llm=FakeLLM(labelled({})))
    assert rows(store_url, "SELECT partition, message_offset, content_hash FROM documents") == [
        (1, 0, content_hash("A"))]


async def test_failed_content_again_at_a_newer_position_costs_no_call(store_url: str) -> None:
    """The same bytes again (a producer's retry) after they ended as a refusal: the letter moves to
    the newest position, with its reason, and the model is not asked again."""
    refuse = "I'm sorry, I can't help with that."
    doc = {"id": "x", "text": "hello"}
    await run_pipeline(two_stage(ListSource([doc]), store_url), llm=FakeLLM(lambda _: refuse))
    again = FakeLLM(lambda _: refuse)
    await run_pipeline(two_stage(ListSource([doc, doc]), store_url), llm=again)
    assert again.calls == []
    assert state(store_url)["letters"] == [("x", 0, "superseded", "refusal"), ("x", 1, "open", "refusal")]


async def test_a_changed_stage_failing_for_two_copies_is_asked_once(store_url: str) -> None:
    """A stored; the Extract stage changes and now truncates; A, A in one run: the second copy takes
    the first one's letter, not a second call."""
    doc = {"id": "x", "text": "t"}
    await run_pipeline(two_stage(ListSource([doc]), store_url), llm=FakeLLM(labelled({"t": "a"})))

    def truncate(request: LLMRequest, _n: int) -> Exception | None:
        return Truncated("max tokens") if "label" not in request.json_schema.get("properties", {}) else None

    pipeline = Pipeline("hostile", ListSource([doc, doc]), [
        Classify(LABELS, "Pick.", name="kind"), Extract(Amount, "Extract v2.", when=label_in("kind", "a"))],
        store=store_url)
    llm = FakeLLM(labelled({"t": "a"}), fault=truncate, latency_s=0.01)
    await run_pipeline(pipeline, llm=llm)
    assert sum("label" not in r.json_schema.get("properties", {}) for r in llm.calls) == 1
    assert state(store_url)["letters"][-1][1:3] == (1, "open")


async def test_bad_input_that_decodes_later_leaves_quarantine(store_url: str) -> None:
    """A message too big for max_bytes=64 is bad input (a letter without tenant or key); with
    max_bytes raised the same message decodes and succeeds: its letter is resolved."""
    value = json.dumps({"id": "x", "text": "hello " * 30}).encode()
    await run_pipeline(two_stage(ListSource([value]), store_url, decoder=Decoder(max_bytes=64)), llm=FakeLLM(labelled({})))
    assert [r[2:] for r in state(store_url)["letters"]] == [("open", "bad_input")]
    await run_pipeline(two_stage(ListSource([value]), store_url, decoder=Decoder(max_bytes=4096)),
                       llm=FakeLLM(labelled({})))
    assert [r[2:] for r in state(store_url)["letters"]] == [("replayed", "bad_input")]


async def test_review_samples_survive_a_newer_copy(store_url: str) -> None:
    from etl.tenancy import ReviewSampling

    doc = {"id": "x", "text": "hello"}
    pipeline = Pipeline("p", ListSource([doc, doc]), [Classify(LABELS, name="kind")], store=store_url,
                        review=ReviewSampling(rate=0.0, below_confidence=None))
    await run_pipeline(pipeline, llm=FakeLLM(labelled({})))
    assert rows(store_url, "SELECT doc_key, sampled_because FROM review_queue") == [("x", "first_label")]
