"""The batch tier against the OpenAI-wire batch test server (etl.testing.batch_server): the same stored
results as synchronous calls at the batch price, nothing sent twice across crashes, re-runs free."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel

from etl import Classify, Extract, Pipeline, label_in, run_pipeline
from etl.testing import BatchServer
from etl.llm.anthropic import AnthropicLLM
from etl.llm.openai_compat import OpenAICompatibleLLM
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import ListSource
from tests.helpers import rows

LABELS = ["billing", "technical", "account", "other"]
PRICES = (2.0, 8.0)  # USD per million tokens, synchronous


class Ticket(BaseModel):
    summary: str
    amount: float


def docs(n: int, duplicates: float = 0.3) -> list[dict[str, str]]:
    """n documents; a share of them repeat an earlier one's text (the same cache keys)."""
    unique = max(1, int(n * (1 - duplicates)))
    return [{"id": f"d{i}", "tenant": "acme", "text": f"ticket {i % unique}: my card was charged {i % unique} times"}
            for i in range(n)]


def model(server: BatchServer, wire: str = "openai") -> OpenAICompatibleLLM | AnthropicLLM:
    if wire == "anthropic":
        return AnthropicLLM("batch-model", base_url=server.root, api_key="test", price_per_mtok=PRICES)
    return OpenAICompatibleLLM(server.url, "batch-model", api_key="test", price_per_mtok=PRICES)


def pipeline(url: str, server: BatchServer, items: list[dict[str, str]], wire: str = "openai") -> Pipeline:
    llm = model(server, wire)
    return Pipeline("backfill", ListSource(items), [
        Classify(LABELS, "Route the ticket.", name="route"),
        Extract(Ticket, "Summarise it.", name="ticket", when=label_in("route", "billing", "account")),
    ], store=url, llm=llm)


def settings() -> Settings:
    return Settings(batch_poll_s=0.05)


def stored(url: str) -> list[tuple[Any, ...]]:
    return rows(url, "SELECT doc_key, stage, output FROM stage_results ORDER BY doc_key, stage")


def cost(url: str) -> float:
    return rows(url, "SELECT coalesce(sum(cost), 0) FROM llm_calls WHERE outcome <> 'cache_hit'")[0][0]


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_batch_mode_stores_what_synchronous_calls_store_at_the_batch_price(tmp_path: Any, wire: str) -> None:
    items = docs(300)
    sync_url, batch_url = f"sqlite:///{tmp_path / 'sync.db'}", f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=2) as server:
        await run_pipeline(pipeline(sync_url, server, items, wire), settings())
        sync_requests = server.requests
        server.requests = 0
        runner = build_runner(pipeline(batch_url, server, items, wire), settings(), batch=True)
        stats = await runner.run()
        await runner.llm.aclose()
        assert stored(batch_url) == stored(sync_url) and len(stored(sync_url)) > 300
        keys = rows(batch_url, "SELECT count(DISTINCT cache_key) FROM llm_cache")[0][0]
        assert server.lines_received == keys == sync_requests  # one request per unique key, waves included
        assert server.requests == server.lines_received
        billed_in, billed_out = server.billed
        assert cost(batch_url) == pytest.approx((billed_in * PRICES[0] + billed_out * PRICES[1]) / 2 / 1e6, rel=1e-9)
        assert cost(batch_url) / cost(sync_url) == pytest.approx(0.5, rel=1e-9)
        batches = len(server.batches if wire == "openai" else server.message_batches)
        assert batches >= 2  # the Extract stage went out in a later wave
        print(f"\nbatch figures ({wire}): {stats.messages} docs, {keys} unique keys, {batches} batches, "
              f"cost sync ${cost(sync_url):.6f} batch ${cost(batch_url):.6f}")

        # a re-run after completion sends nothing and writes nothing
        before = (server.http_requests, rows(batch_url, "SELECT count(*) FROM llm_calls"), stored(batch_url))
        runner = build_runner(pipeline(batch_url, server, items, wire), settings(), batch=True)
        await runner.run()
        await runner.llm.aclose()
        assert (server.http_requests, rows(batch_url, "SELECT count(*) FROM llm_calls"), stored(batch_url)) == before


async def test_a_crashed_batch_run_resumes_its_batches_instead_of_sending_them_again(tmp_path: Any) -> None:
    items = docs(200)
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=10_000) as server:  # answers only when allowed to
        for _ in range(3):  # crash while its batches are live, three times
            runner = build_runner(pipeline(url, server, items), settings(), batch=True)
            run = asyncio.create_task(runner.run())
            while server.lines_received == 0 or any(b["status"] == "validating" for b in server.batches.values()):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            await runner.llm.aclose()
        sent = server.lines_received
        assert sent == rows(url, "SELECT count(*) FROM llm_batch_items")[0][0]
        server.polls = 0
        runner = build_runner(pipeline(url, server, items), settings(), batch=True)
        await runner.run()
        await runner.llm.aclose()
        keys = rows(url, "SELECT count(DISTINCT cache_key) FROM llm_cache")[0][0]
        assert server.lines_received == keys  # nothing sent twice: the first wave once, then the Extract wave
        assert rows(url, "SELECT count(DISTINCT doc_key) FROM stage_results WHERE stage = 'route'") == [(200,)]


async def test_batch_faults_end_as_typed_dead_letters_or_resubmissions(tmp_path: Any) -> None:
    items = [{"id": "ok", "tenant": "acme", "text": "fine"}, {"id": "flaky", "tenant": "acme", "text": "x [fault:500x1]"},
             {"id": "broken", "tenant": "acme", "text": "y [fault:500x99]"}]
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=3) as server:
        server.duplicate_lines = server.unknown_lines = True
        # Resent by the batch tier itself, however long batches take (longer than llm_max_retry_s here)
        runner = build_runner(pipeline(url, server, items), Settings(batch_poll_s=0.05, llm_max_attempts=3,
                                                                   llm_max_retry_s=0.01), batch=True)
        await runner.run()
        await runner.llm.aclose()
        assert {k for (k,) in rows(url, "SELECT doc_key FROM stage_results WHERE stage = 'route'")} == {"ok", "flaky"}
        assert rows(url, "SELECT doc_key, reason FROM dead_letters") == [("broken", "provider_error")]
        # broken went out as often as allowed (3), flaky twice for its first stage; every line counted once
        assert max(server.attempts.values()) == 3 and sum(server.attempts.values()) == server.lines_received
        assert runner.llm.stats["ignored"] > 0  # the repeated and unknown lines were ignored
        billed_in, billed_out = server.billed  # the repeated line added no cost
        assert cost(url) == pytest.approx((billed_in * PRICES[0] + billed_out * PRICES[1]) / 2 / 1e6, rel=1e-9)


async def test_an_expired_batch_is_sent_again_and_a_refused_line_is_not(tmp_path: Any) -> None:
    items = [{"id": "a", "tenant": "acme", "text": "one"}, {"id": "b", "tenant": "acme", "text": "two [fault:context]"}]
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=1) as server:
        server.expire_next = 1
        runner = build_runner(pipeline(url, server, items), Settings(batch_poll_s=0.05), batch=True)
        await runner.run()
        await runner.llm.aclose()
        assert [s["status"] for s in server.batches.values()][:2] == ["expired", "completed"]
        assert rows(url, "SELECT doc_key FROM stage_results WHERE stage = 'route'") == [("a",)]
        assert rows(url, "SELECT doc_key, reason FROM dead_letters") == [("b", "context_overflow")]


async def test_batch_status_lists_live_batches_and_cancel_stops_them(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from etl.cli import app

    items = docs(20, duplicates=0)
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=10_000) as server:
        runner = build_runner(pipeline(url, server, items), settings(), batch=True)
        run = asyncio.create_task(runner.run())
        while not server.batches:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        await runner.llm.aclose()
        shown = CliRunner().invoke(app, ["batch", "status", "--db", url])
        (provider_id,) = list(server.batches)
        assert shown.exit_code == 0 and provider_id in shown.output and "submitted" in shown.output, shown.output
        canceller = build_runner(pipeline(url, server, items), settings(), batch=True)
        assert await canceller.llm.cancel_live() == [provider_id]  # type: ignore[attr-defined]
        await canceller.llm.aclose()
        assert server.batches[provider_id]["status"] == "cancelled"
        # the next run sees the cancellation and sends the unanswered requests again
        server.polls = 0
        runner = build_runner(pipeline(url, server, items), settings(), batch=True)
        await runner.run()
        await runner.llm.aclose()
        assert rows(url, "SELECT count(*) FROM stage_results WHERE stage = 'route'") == [(20,)]
        assert "no live batches" in CliRunner().invoke(app, ["batch", "status", "--db", url]).output


async def test_a_batch_recorded_but_never_created_is_abandoned_and_one_created_but_unrecorded_is_adopted(
        tmp_path: Any) -> None:
    """The two crashes around the create: after recording, before the provider made it (sent
    again, once); after the provider made it, before its id was recorded (found by metadata)."""
    from openai import OpenAI

    from connectors.store import make_engine, upgrade
    from connectors.store.batches import BatchLedger
    from etl.llm.batch_wire import META, OpenAIWire

    items = docs(40, duplicates=0)
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=0) as server:
        probe = build_runner(pipeline(url, server, items), settings(), batch=True)
        upgrade(make_engine(url))
        keys = probe.executor.keys  # the stage-1 cache key of each document, as the run computes them
        plans = probe.executor.plans_for("acme")
        from dedup import content_hash
        from schemas import Document, Position

        def key_of(item: dict[str, str]) -> str:
            doc = Document(tenant="acme", key=item["id"], content=item["text"], content_hash=content_hash(item["text"]),
                           position=Position(stream="list", offset=0))
            return keys(doc)[0]

        first, second = [key_of(i) for i in items[:20]], [key_of(i) for i in items[20:]]
        await probe.llm.aclose()
        assert plans and len(set(first + second)) == 40
        ledger = BatchLedger(make_engine(url), "backfill", server.url)
        never = ledger.new_id()
        ledger.record(never, first)  # the process died before the provider heard of it
        adopted = ledger.new_id()
        ledger.record(adopted, second)
        client = OpenAI(base_url=server.url, api_key="test", max_retries=0)
        # (any body: what matters is which custom_ids go out again; an answer to it is repaired)
        body = lambda c: {"model": "batch-model", "messages": [{"role": "user", "content": "x"}]}  # noqa: E731
        upload = client.files.create(file=("in.jsonl", "".join(
            json.dumps({"custom_id": c, "method": "POST", "url": OpenAIWire.ENDPOINT, "body": body(c)}) + "\n" for c in second
        ).encode()), purpose="batch")
        client.batches.create(input_file_id=upload.id, endpoint=OpenAIWire.ENDPOINT, completion_window="24h",
                              metadata={META: adopted})  # made, and then the process died
        received_before = server.lines_received
        runner = build_runner(pipeline(url, server, items), settings(), batch=True)
        await runner.run()
        await runner.llm.aclose()
        status = dict(rows(url, "SELECT id, status FROM llm_batches"))
        assert status[never] == "abandoned" and status[adopted] == "completed"
        held = rows(url, "SELECT custom_id, batch_id FROM llm_batch_items")
        batches_of = {c: sorted(b for k, b in held if k == c) for c in first + second}
        assert all(batches_of[c] == [adopted] for c in second)  # adopted: not sent again
        assert all(len(batches_of[c]) == 2 and batches_of[c][0] == never for c in first)  # sent again, once
        assert server.lines_received > received_before
        assert rows(url, "SELECT count(DISTINCT doc_key) FROM stage_results WHERE stage = 'route'") == [(40,)]


async def test_a_store_failure_after_the_create_neither_loses_nor_resends_requests(tmp_path: Any) -> None:
    """The provider made the batch, then recording its id failed: the next round finds it by its
    metadata and waits for it; nothing is lost, nothing sent twice."""
    items = docs(50, duplicates=0)
    url = f"sqlite:///{tmp_path / 'batch.db'}"
    with BatchServer(polls=1) as server:
        runner = build_runner(pipeline(url, server, items), settings(), batch=True)
        ledger = runner.llm.ledger  # type: ignore[attr-defined]
        real, failed = ledger.submitted, []

        def flaky(batch_id: str, provider_id: str) -> None:
            if not failed:
                failed.append(batch_id)
                raise OSError("the store went away")
            real(batch_id, provider_id)

        ledger.submitted = flaky
        await runner.run()
        await runner.llm.aclose()
        assert failed and rows(url, f"SELECT status FROM llm_batches WHERE id = '{failed[0]}'") == [("completed",)]
        keys = rows(url, "SELECT count(DISTINCT cache_key) FROM llm_cache")[0][0]
        assert server.lines_received == keys
        assert rows(url, "SELECT count(DISTINCT doc_key) FROM stage_results WHERE stage = 'route'") == [(50,)]


async def test_a_kafka_backfill_reads_up_to_the_end_offsets_at_its_start(kafka_bootstrap: str, topic: str,
                                                                        postgres_url: str) -> None:
    """`--batch` on a Kafka source: a consumer-group member from the stored positions up to the end
    offsets when it started, then the run ends; what arrives later is the next backfill's."""
    from connectors.sources.kafka import KafkaSource
    from tests.helpers import end_offsets, produce

    items = docs(240)
    produce(kafka_bootstrap, topic, [(d["id"].encode(), json.dumps(d).encode()) for d in items[:200]])

    def kafka_pipeline(server: BatchServer) -> Pipeline:
        llm = OpenAICompatibleLLM(server.url, "batch-model", api_key="test", price_per_mtok=PRICES)
        return Pipeline("backfill", KafkaSource(topic, group=f"{topic}-batch", bootstrap=kafka_bootstrap),
                        [Classify(LABELS, "Route the ticket.", name="route")], store=postgres_url, llm=llm)

    with BatchServer(polls=1) as server:
        stats = await run_pipeline(kafka_pipeline(server), settings(), batch=True)
        assert stats.messages == 200
        assert rows(postgres_url, "SELECT count(*) FROM stage_results") == [(200,)]
        first = server.lines_received
        assert first == len({d["text"] for d in items[:200]})
        positions = dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions"))
        assert positions == end_offsets(kafka_bootstrap, topic)

        produce(kafka_bootstrap, topic, [(d["id"].encode(), json.dumps(d).encode()) for d in items[200:]])
        stats = await run_pipeline(kafka_pipeline(server), settings(), batch=True)
        assert stats.messages == 40 and rows(postgres_url, "SELECT count(*) FROM stage_results") == [(240,)]
        assert server.lines_received == len({d["text"] for d in items})  # only the new contents went out

        stats = await run_pipeline(kafka_pipeline(server), settings(), batch=True)
        assert stats.messages == 0 and server.lines_received == len({d["text"] for d in items})
