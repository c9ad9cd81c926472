"""Per-field confidence (issue 27): from token log-probabilities where the backend reports them,
from agreement across a long document's chunks otherwise; cached with the answer (a redelivery
costs nothing and keeps it), stored beside each value's span, calibrated on the golden set and shown
in the report. Classify over long documents by a vote of its chunks; ``grounding="reask"``."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from openai import OpenAI
from pydantic import BaseModel, field_validator
from sqlalchemy import create_engine
from typer.testing import CliRunner

from connectors.store.report import status
from etl.cli.app import app

from etl import Classify, Extract, OpenAICompatibleLLM, Pipeline, run_pipeline
from etl.llm.base import LLMRequest
from etl.quality.golden import evaluate, import_golden
from etl.quality.report import write_report
from etl.stages.chunking import Chunking
from etl.testing import FakeLLM, FaultServer, ListSource, value_logprobs
from tests.helpers import counts, rows


class Item(BaseModel):
    company: str
    total: float | None


class Bundle(BaseModel):
    vendor: str | None
    receipts: list[Item]


def blocks(n: int) -> list[str]:
    return [f"RECEIPT {i}\nSHOP NUMBER {i} SDN BHD\nJALAN {i} TAMAN KEBUN\nTHANK YOU COME AGAIN\nTOTAL {i}.50\nVENDOR ACME" for i in range(n)]


def reader(request: LLMRequest) -> dict[str, Any]:
    """Reads what it is given: one item per receipt block of its chunk, the vendor line."""
    text = request.messages[-1]["content"]
    items = [{"company": line.strip(), "total": float(text.split("TOTAL ", 1)[1].split()[0]) if "TOTAL" in text else None}
             for line in text.splitlines() if line.startswith("SHOP")]
    for number, block in enumerate(text.split("RECEIPT ")[1:]):
        if "TOTAL " in block and number < len(items):
            items[number]["total"] = float(block.split("TOTAL ", 1)[1].split()[0])
    return {"vendor": "ACME" if "VENDOR ACME" in text else None, "receipts": items}


def sure_of(request: LLMRequest, path: str) -> float:
    """Each value's probability, a function of the value's place, so the test can predict it."""
    return 0.5 if path.endswith("total") else 0.9


def pipeline(url: str, docs: list[dict[str, Any]], *stages: Any) -> Pipeline:
    return Pipeline("conf", ListSource(docs), list(stages), store=url)


def bundle_stage(**extra: Any) -> Extract:
    return Extract(Bundle, "Extract the vendor and every receipt.", name="bundle", chunking=Chunking(max_tokens=64),
                   **extra)


async def test_chunk_logprobs_become_each_merged_value_s_confidence_and_survive_a_redelivery(store_url: str) -> None:
    document = "\n\n".join(blocks(12))
    llm = FakeLLM(reader, logprobs=value_logprobs(sure_of))
    stats = await run_pipeline(pipeline(store_url, [{"id": "b1", "text": document}], bundle_stage()), llm=llm)
    assert stats.results_written == 1 and len(llm.calls) > 3
    spans = {path: (conf, source) for path, conf, source in
             rows(store_url, "SELECT path, confidence, confidence_from FROM field_spans")}
    (output,) = [json.loads(o) if isinstance(o, str) else o for (o,) in rows(store_url, "SELECT output FROM stage_results")]
    assert len(output["receipts"]) == 12
    for number in range(12):  # every merged item carries the probability its chunk gave it
        assert spans[f"receipts[{number}].company"] == (0.9, "logprob")
        assert spans[f"receipts[{number}].total"] == (0.5, "logprob")
    assert spans["vendor"] == (0.9, "logprob")

    # etl status shows the chunks and the grounded values, with the same figures as the tables
    shown = CliRunner().invoke(app, ["status", "--db", store_url])
    assert shown.exit_code == 0, shown.output
    chunks = counts(store_url, ("stage_chunks",))["stage_chunks"]
    assert "Long documents" in shown.output and f"{chunks}" in shown.output.split("Long documents")[1]
    assert "found in their document's text" in shown.output
    (chunked,) = status(create_engine(store_url))["chunks"]
    assert (chunked["documents"], chunked["chunks"], chunked["chunks_from_cache"]) == (1, chunks, 0)
    (grounded,) = status(create_engine(store_url))["grounding"]
    assert grounded["values"] == len(spans) and grounded["with_confidence"] == len(spans)

    before = counts(store_url, ("stage_results", "llm_cache", "field_spans"))
    again = FakeLLM(reader, logprobs=value_logprobs(sure_of))
    stats = await run_pipeline(pipeline(store_url, [{"id": "b1", "text": document}], bundle_stage()), llm=again)
    assert len(again.calls) == stats.llm_calls == stats.results_written == 0
    assert counts(store_url, tuple(before)) == before
    # a copy of the same document: served from the cache, with the same confidences
    stats = await run_pipeline(pipeline(store_url, [{"id": "b2", "text": document}], bundle_stage()), llm=again)
    assert len(again.calls) == 0 and stats.results_written == 1
    copy = dict(rows(store_url, "SELECT path, confidence FROM field_spans WHERE doc_key = 'b2'"))
    assert copy == {path: conf for path, (conf, _) in spans.items()}


async def test_without_logprobs_a_scalar_field_s_confidence_is_the_chunks_agreement(sqlite_url: str) -> None:
    # the vendor line is in the last 3 of 12 blocks: chunks that do not see it answer null, and
    # null is no vote; two chunks say ACME, one says GLOBEX
    texts = blocks(12)
    def vendor(request: LLMRequest) -> dict[str, Any]:
        answer = reader(request)
        answer["vendor"] = "GLOBEX" if "RECEIPT 0\n" in request.messages[-1]["content"] else answer["vendor"]
        return answer
    stage = Extract(Bundle, "Extract.", name="bundle", chunking=Chunking(max_tokens=64), merge={"vendor": "majority"})
    llm = FakeLLM(vendor)
    await run_pipeline(pipeline(sqlite_url, [{"id": "b", "text": "\n\n".join(texts)}], stage), llm=llm)
    chunk_answers = [vendor(r)["vendor"] for r in llm.calls]
    voted = [v for v in chunk_answers if v is not None]
    (value, conf, source), = rows(sqlite_url, "SELECT value, confidence, confidence_from FROM field_spans WHERE path = 'vendor'")
    assert source == "agreement" and value == max(set(voted), key=voted.count)
    assert math.isclose(conf, voted.count(value) / len(voted), abs_tol=1e-6)
    assert rows(sqlite_url, "SELECT count(*) FROM field_spans WHERE path != 'vendor' AND confidence IS NOT NULL") == [(0,)]


async def test_classify_a_long_document_by_its_chunks_vote_or_by_its_head(store_url: str) -> None:
    paragraphs = [f"Paragraph {i}: " + ("card was declined at the shop. " if i % 3 else "how do I change my pin? ") * 4
                  for i in range(15)]
    document = "\n\n".join(paragraphs)
    def label(request: LLMRequest) -> dict[str, Any]:
        text = request.messages[-1]["content"]
        return {"label": "declined" if text.count("declined") >= text.count("pin?") else "pin"}
    vote = Classify(["declined", "pin"], "Intent?", name="intent", chunking=Chunking(max_tokens=80))
    llm = FakeLLM(label)
    await run_pipeline(pipeline(store_url, [{"id": "d", "text": document}], vote), llm=llm)
    answers = [label(r)["label"] for r in llm.calls]
    assert len(answers) == counts(store_url, ("stage_chunks",))["stage_chunks"] > 3
    (output,) = [json.loads(o) if isinstance(o, str) else o for (o,) in rows(store_url, "SELECT output FROM stage_results")]
    winner = max(set(answers), key=answers.count)
    assert output["label"] == winner and math.isclose(output["confidence"], answers.count(winner) / len(answers), abs_tol=1e-6)

    # one paragraph edited: only the chunks around it are asked again; a re-run asks nothing
    edited = "\n\n".join([*paragraphs[:7], paragraphs[7].replace("Paragraph 7", "Paragraph seven"), *paragraphs[8:]])
    again = FakeLLM(label)
    await run_pipeline(pipeline(store_url, [{"id": "d", "text": edited}], vote), llm=again)
    assert 1 <= len(again.calls) <= 2
    still = FakeLLM(label)
    await run_pipeline(pipeline(store_url, [{"id": "d", "text": edited}], vote), llm=still)
    assert len(still.calls) == 0

    head = Classify(["declined", "pin"], "Intent?", name="intent", chunking=Chunking(max_tokens=80), vote="head")
    first = FakeLLM(label)
    await run_pipeline(pipeline(store_url, [{"id": "h", "text": "\n\n".join(reversed(paragraphs))}], head), llm=first)
    assert len(first.calls) == 1 and first.calls[0].messages[-1]["content"].startswith("Paragraph 14")
    # the head of the voted document is a chunk the vote already paid for
    cached = FakeLLM(label)
    await run_pipeline(pipeline(store_url, [{"id": "h2", "text": document}], head), llm=cached)
    assert len(cached.calls) == 0


async def test_reask_names_the_values_the_text_does_not_hold_and_keeps_the_grounded_answer(store_url: str) -> None:
    text = "SHOP NUMBER 1 SDN BHD\nTOTAL 12.50"
    def invents_first(request: LLMRequest) -> dict[str, Any]:
        repaired = any("do not appear in the text" in m["content"] or "does not appear in the text" in m["content"]
                       for m in request.messages)
        return {"company": "SHOP NUMBER 1 SDN BHD" if repaired else "MADE UP TRADING", "total": 12.5}
    llm = FakeLLM(invents_first)
    stage = Extract(Item, "Extract.", name="item", grounding="reask")
    stats = await run_pipeline(pipeline(store_url, [{"id": "r", "text": text}], stage), llm=llm)
    assert len(llm.calls) == stats.llm_calls == 2 and "company='MADE UP TRADING'" in llm.calls[1].messages[-1]["content"]
    assert rows(store_url, "SELECT outcome, error FROM llm_calls ORDER BY id") == [("repair", "ungrounded"), ("ok", None)]
    assert sorted(rows(store_url, "SELECT path, match FROM field_spans")) == [("company", "exact"), ("total", "number")]
    again = FakeLLM(invents_first)
    stats = await run_pipeline(pipeline(store_url, [{"id": "r", "text": text}], stage), llm=again)
    assert len(again.calls) == stats.results_written == 0
    # reask decides answers, so it is in the fingerprint; flag and quarantine only check them
    keys = {g: Pipeline("p", ListSource([]), [Extract(Item, "Extract.", name="item", grounding=g)]).stages[0].spec()
            for g in ("flag", "quarantine", "reask")}
    assert keys["flag"] == keys["quarantine"] != keys["reask"]


async def test_a_failed_reask_keeps_the_valid_answer_it_was_to_improve(store_url: str) -> None:
    """Found in review: a re-asked answer that was prose made a dead letter of a document whose
    first answer was valid (and paid for). The first answer stands, its ungrounded value flagged."""
    text = "SHOP NUMBER 1 SDN BHD\nTOTAL 12.50"
    def prose_when_asked_again(request: LLMRequest) -> Any:
        if len(request.messages) > 2:
            return "Sorry, I cannot find a company in this text."
        return {"company": "MADE UP TRADING", "total": 12.5}
    stage = Extract(Item, "Extract.", name="item", grounding="reask")
    llm = FakeLLM(prose_when_asked_again)
    stats = await run_pipeline(pipeline(store_url, [{"id": "r", "text": text}], stage), llm=llm)
    assert len(llm.calls) == stats.llm_calls == 2 and stats.results_written == 1 and stats.dead_letters == 0
    assert rows(store_url, "SELECT outcome, error FROM llm_calls ORDER BY id") == [
        ("ok", "ungrounded"), ("repair", "schema_invalid")]  # one final outcome: the stage ran once
    assert sorted(rows(store_url, "SELECT path, match FROM field_spans")) == [("company", "none"), ("total", "number")]
    again = FakeLLM(prose_when_asked_again)
    stats = await run_pipeline(pipeline(store_url, [{"id": "r", "text": text}], stage), llm=again)
    assert len(again.calls) == stats.results_written == 0


class Ordered(BaseModel):
    receipts: list[Item]

    @field_validator("receipts")
    @classmethod
    def by_total(cls, receipts: list[Item]) -> list[Item]:
        return sorted(receipts, key=lambda item: item.total or 0.0)


async def test_confidence_follows_the_validated_value_not_the_raw_answer_s_place(store_url: str) -> None:
    """Found in review: confidence was read from the raw answer by path, so a key the schema drops
    (one PostgreSQL's JSONB refuses: NUL, a lone surrogate) made a paid answer a dead letter, and a
    validator that reorders a list gave each item another item's confidence."""
    text = "SHOP B\nTOTAL 9.00\nSHOP A\nTOTAL 1.00"
    def answer(request: LLMRequest) -> dict[str, Any]:
        return {"receipts": [{"company": "SHOP B", "total": 9.0}, {"company": "SHOP A", "total": 1.0}],
                "x\u0000y": 1, "\ud800": "lone"}
    def sure(request: LLMRequest, path: str) -> float:
        return 0.8 if path.startswith("receipts[0]") else 0.3  # the raw answer's first item is the sure one
    stage = Extract(Ordered, "Extract.", name="ordered")
    llm = FakeLLM(answer, logprobs=value_logprobs(sure))
    stats = await run_pipeline(pipeline(store_url, [{"id": "o", "text": text}], stage), llm=llm)
    assert stats.results_written == 1 and stats.dead_letters == 0
    got = dict(rows(store_url, "SELECT path, confidence FROM field_spans"))
    # stored sorted: SHOP A first; its values moved, so the raw answer's confidences do not follow
    # them to the other item, and the keys the schema dropped are nowhere
    assert rows(store_url, "SELECT value FROM field_spans WHERE path = 'receipts[0].company'") == [("SHOP A",)]
    assert got == {"receipts[0].company": None, "receipts[0].total": None,
                   "receipts[1].company": None, "receipts[1].total": None}
    (cached,) = rows(store_url, "SELECT confidence FROM llm_cache")
    assert cached[0] is None


async def test_calibration_on_the_golden_set_is_measured_stored_and_drawn(tmp_path: Path, store_url: str) -> None:
    """A simulated extractor whose confidence is calibrated by construction: a value given
    probability p is right with probability p. The eval must find an ECE near 0, and one that
    always says 0.95 while right 60% of the time must show a gap near 0.35."""
    rng = random.Random(7)
    golden = [{"doc_key": f"g{i}", "tenant": "acme", "content": f"SHOP {i}\nTOTAL {i}.50",
               "expected": {"company": f"SHOP {i}", "total": i + 0.5}} for i in range(400)]
    sureness = {e["content"]: {"company": rng.uniform(0.05, 1.0), "total": rng.uniform(0.05, 1.0)} for e in golden}
    right = {(c, f): rng.random() < p for c, fields in sureness.items() for f, p in fields.items()}

    def answer(request: LLMRequest) -> dict[str, Any]:
        text = request.messages[-1]["content"]
        shop, total = text.split("\n")
        return {"company": shop if right[(text, "company")] else "WRONG",
                "total": float(total.split()[1]) if right[(text, "total")] else 0.0}

    def probability(request: LLMRequest, path: str) -> float:
        return sureness[request.messages[-1]["content"]][path]

    engine = create_engine(store_url)
    import_golden(engine, "conf", "item", golden)
    stage = Extract(Item, "Extract.", name="item", grounding="off")
    (run,) = await evaluate(engine, pipeline(store_url, [], stage), FakeLLM(answer, logprobs=value_logprobs(probability)))
    calibrated = run["details"]["calibration"]
    print(f"\ncalibrated simulator: ECE {calibrated['ece']} over {calibrated['pairs']} values")
    assert calibrated["pairs"] == 800 and calibrated["sources"] == {"logprob": 800}
    assert calibrated["ece"] <= 0.06

    (over,) = await evaluate(engine, pipeline(store_url, [], stage),
                             FakeLLM(answer, model_id="overconfident", logprobs=value_logprobs(lambda r, p: 0.95)))
    share = sum(right.values()) / len(right)
    assert math.isclose(over["details"]["calibration"]["ece"], abs(0.95 - share), abs_tol=1e-3)

    page = write_report(engine, tmp_path / "report").read_text()
    section = page.split('<section id="grounding">')[1].split("</section>")[0]
    assert section.count("<svg") == 1 and section.count("<circle") >= 2 and "overconfident" in section
    assert f"{over['details']['calibration']['ece']:.3f}" in section


async def test_openai_logprobs_on_the_wire_as_the_official_client_reads_them(sqlite_url: str) -> None:
    with FaultServer() as server:
        official = OpenAI(base_url=server.url, api_key="test").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "SHOP 1\nTOTAL 1.50"}], logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": Item.model_json_schema()}})
        pieces = official.choices[0].logprobs.content
        assert "".join(p.token for p in pieces) == official.choices[0].message.content
        assert all(math.isclose(p.logprob, math.log(0.9)) for p in pieces)
        llm = OpenAICompatibleLLM(server.url, "m", api_key="test", logprobs=True)
        await run_pipeline(pipeline(sqlite_url, [{"id": "r", "text": "SHOP 1\nTOTAL 1.50"}],
                                    Extract(Item, "Extract.", name="item")), llm=llm)
        await llm.aclose()
    confidences = dict(rows(sqlite_url, "SELECT path, confidence FROM field_spans"))
    assert set(confidences) == {"company", "total"}
    assert all(0 < c < 1 for c in confidences.values())  # a few four-character tokens of p = 0.9 each


async def test_eval_answers_a_long_golden_document_in_chunks_as_a_run_does(sqlite_url: str) -> None:
    document = "\n\n".join(blocks(12))
    engine = create_engine(sqlite_url)
    import_golden(engine, "conf", "bundle", [{"doc_key": "g", "tenant": "acme", "content": document,
                                             "expected": {"vendor": "ACME"}}])
    llm = FakeLLM(reader)
    (run,) = await evaluate(engine, pipeline(sqlite_url, [], bundle_stage()), llm)
    assert len(llm.calls) > 3 and all(len(r.messages[-1]["content"]) < len(document) / 3 for r in llm.calls)
    assert run["accuracy"] == 1.0 and run["failed"] == 0
    # every chunk saw the vendor line and said ACME: the merged vendor's confidence is their agreement
    assert run["details"]["calibration"]["sources"] == {"agreement": 1}


def _buggy(output: BaseModel) -> str | None:
    raise TypeError("a validator's own bug")


async def test_every_paid_answer_is_recorded_whatever_its_parse_raises(store_url: str) -> None:
    """Found in review: an answer Python's json will not read (an integer of 5,000 digits raises
    ValueError, not JSONDecodeError) or a validator that raises instead of answering left the paid
    attempt out of llm_calls; a re-ask that did so lost its cost from the kept answer."""
    from etl.validators import Check

    text = "SHOP NUMBER 1\nTOTAL 12.50"
    huge = '{"company": "SHOP NUMBER 1", "total": ' + "1" * 5000 + "}"
    docs = [{"id": "digits", "text": text}]
    llm = FakeLLM(lambda request: huge)
    stats = await run_pipeline(pipeline(store_url, docs, Extract(Item, "Extract.", name="item")), llm=llm)
    assert len(llm.calls) == stats.llm_calls == 2 and stats.dead_letters == 1  # re-asked once, then given up
    assert rows(store_url, "SELECT outcome, error FROM llm_calls WHERE doc_key = 'digits' ORDER BY id") == [
        ("repair", "schema_invalid"), ("failed", "schema_invalid")]

    buggy = Extract(Item, "Extract.", name="checked", validators=[Check("buggy", _buggy)])
    llm = FakeLLM(lambda request: {"company": "SHOP NUMBER 1", "total": 12.5})
    stats = await run_pipeline(pipeline(store_url, [{"id": "bug", "text": text}], buggy), llm=llm)
    assert len(llm.calls) == stats.llm_calls == 1 and stats.dead_letters == 1
    assert rows(store_url, "SELECT outcome, error FROM llm_calls WHERE doc_key = 'bug'") == [("failed", "stage_error")]
    assert rows(store_url, "SELECT reason FROM dead_letters WHERE doc_key = 'bug'") == [("stage_error",)]

    def unreadable(request: LLMRequest) -> Any:  # a provider's 200 the backend could not read
        raise AttributeError("'str' object has no attribute 'get'")
    llm = FakeLLM(unreadable)
    stats = await run_pipeline(pipeline(store_url, [{"id": "unread", "text": text}], Extract(Item, "E.", name="u")),
                               llm=llm)
    assert len(llm.calls) == stats.llm_calls == 1 and stats.dead_letters == 1
    assert rows(store_url, "SELECT outcome, error FROM llm_calls WHERE doc_key = 'unread'") == [("failed", "stage_error")]

    def huge_when_asked_again(request: LLMRequest) -> Any:
        return huge if len(request.messages) > 2 else {"company": "MADE UP", "total": 12.5}
    llm = FakeLLM(huge_when_asked_again, price_per_mtok=(1.0, 1.0))
    reask = Extract(Item, "Extract.", name="reasked", grounding="reask")
    stats = await run_pipeline(pipeline(store_url, [{"id": "kept", "text": text}], reask), llm=llm)
    assert len(llm.calls) == stats.llm_calls == 2 and stats.results_written == 1
    paid = rows(store_url, "SELECT outcome, cost FROM llm_calls WHERE doc_key = 'kept' ORDER BY id")
    assert [outcome for outcome, _ in paid] == ["ok", "repair"]
    assert rows(store_url, "SELECT cost FROM llm_cache WHERE stage = 'reasked'") == [(sum(c for _, c in paid),)]
    again = FakeLLM(huge_when_asked_again)
    stats = await run_pipeline(pipeline(store_url, [{"id": "kept", "text": text}], reask), llm=again)
    assert len(again.calls) == stats.results_written == 0  # a redelivery of the kept answer costs nothing


async def test_upgrading_turns_a_json_null_confidence_into_sql_null(store_url: str) -> None:
    """Revision 0013's code stored "no confidence" as JSON null, which ``IS NULL`` does not find."""
    from alembic import command
    from alembic.config import Config

    from connectors.store.sql import MIGRATIONS

    llm = FakeLLM(lambda request: {"company": "SHOP", "total": 1.0})
    await run_pipeline(pipeline(store_url, [{"id": "r", "text": "SHOP\nTOTAL 1.00"}], Extract(Item, "E.", name="item")),
                       llm=llm)
    engine = create_engine(store_url)
    postgres = engine.dialect.name == "postgresql"
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:  # as that code left it, at that revision
        config.attributes["connection"] = conn
        command.downgrade(config, "0014")  # the revisions after it undone
        conn.exec_driver_sql("UPDATE llm_cache SET confidence = " + ("'null'::jsonb" if postgres else "'null'"))
    assert rows(store_url, "SELECT count(*) FROM llm_cache WHERE confidence IS NULL") == [(0,)]
    result = CliRunner().invoke(app, ["db", "upgrade", "--db", store_url])
    assert result.exit_code == 0, result.output
    assert rows(store_url, "SELECT count(*) FROM llm_cache WHERE confidence IS NULL") == [(1,)]
    engine.dispose()
