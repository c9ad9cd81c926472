"""The batch test server speaks OpenAI's Files and Batches wire: checked with the official SDK, so
the format is the provider's, not ours (the groundwork of issue 13's batch tier)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import OpenAI

from etl.testing import BatchServer

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]}}, "required": ["label"]}


def line(custom_id: str, text: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 50,
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "strict": True, "schema": SCHEMA}}}}


def submit(client: OpenAI, lines: list[dict[str, Any]], **metadata: str) -> Any:
    upload = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata=metadata or None)


def results(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


@pytest.fixture
def server() -> Any:
    with BatchServer(polls=2, seed=7) as s:
        yield s


def test_results_by_custom_id_out_of_order_after_polls(server: BatchServer) -> None:
    client = OpenAI(base_url=server.url, api_key="test", max_retries=0)
    batch = submit(client, [line(f"k{i}", f"doc {i}") for i in range(20)], idem_batch="local-1")
    assert batch.status == "validating" and batch.metadata == {"idem_batch": "local-1"}
    assert [client.batches.retrieve(batch.id).status for _ in range(2)] == ["in_progress", "in_progress"]
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 20 and done.error_file_id is None
    out = results(client, done.output_file_id)
    ids = [r["custom_id"] for r in out]
    assert sorted(ids) == sorted(f"k{i}" for i in range(20)) and ids != sorted(ids, key=lambda k: int(k[1:]))
    answer = out[0]["response"]["body"]
    assert json.loads(answer["choices"][0]["message"]["content"])["label"] in ("a", "b")
    assert server.billed == [sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out),
                             sum(r["response"]["body"]["usage"]["completion_tokens"] for r in out)]
    # found again by its metadata, as a restart that lost the provider's id would
    assert [b.id for b in client.batches.list() if (b.metadata or {}).get("idem_batch") == "local-1"] == [batch.id]
    assert server.lines_received == 20 and server.http_requests == 1 + 1 + 3 + 1 + 1


def test_errored_expired_failed_and_cancelled_batches(server: BatchServer) -> None:
    client = OpenAI(base_url=server.url, api_key="test", max_retries=0)
    server.polls = 0
    errored = client.batches.retrieve(submit(client, [line("ok", "fine"), line("bad", "x [fault:500x1]")]).id)
    assert errored.status == "completed" and errored.request_counts.failed == 1
    assert [r["custom_id"] for r in results(client, errored.output_file_id)] == ["ok"]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in results(client, errored.error_file_id)] == [
        ("bad", 500)]

    server.expire_next = 1
    expired = client.batches.retrieve(submit(client, [line("e1", "one"), line("e2", "two")]).id)
    assert expired.status == "expired" and expired.output_file_id is None
    assert {(r["custom_id"], r["error"]["code"]) for r in results(client, expired.error_file_id)} == {
        ("e1", "batch_expired"), ("e2", "batch_expired")}

    server.fail_next = 1
    assert submit(client, [line("f1", "one")]).status == "failed"
    duplicate = submit(client, [line("d", "one"), line("d", "two")])
    assert duplicate.status == "failed" and duplicate.errors.data[0].code == "invalid_request"

    server.polls = 5
    cancelled = client.batches.cancel(submit(client, [line("c1", "one")]).id)
    assert cancelled.status == "cancelled"
    assert [r["error"]["code"] for r in results(client, cancelled.error_file_id)] == ["batch_cancelled"]


def test_duplicate_and_unknown_result_lines(server: BatchServer) -> None:
    client = OpenAI(base_url=server.url, api_key="test", max_retries=0)
    server.polls, server.duplicate_lines, server.unknown_lines = 0, True, True
    done = client.batches.retrieve(submit(client, [line("a", "one"), line("b", "two")]).id)
    ids = [r["custom_id"] for r in results(client, done.output_file_id)]
    assert sorted(ids) == sorted(["a", "b", ids[0], "never-sent"]) and len(ids) == 4


# -- Anthropic's wire, checked with the official `anthropic` client --------------------------------

def params(text: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": text}],
            "tools": [{"name": "output", "description": "Record the answer.", "input_schema": SCHEMA}],
            "tool_choice": {"type": "tool", "name": "output"}}


def test_anthropic_messages_answer_with_the_forced_tool(server: BatchServer) -> None:
    from anthropic import Anthropic, BadRequestError, RateLimitError

    client = Anthropic(base_url=server.root, api_key="test", max_retries=0)
    message = client.messages.create(**params("doc 1"))  # type: ignore[arg-type]
    tool = message.content[0]
    assert message.stop_reason == "tool_use" and tool.type == "tool_use" and tool.input["label"] in ("a", "b")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    cut = client.messages.create(**params("doc [fault:truncated]"))  # type: ignore[arg-type]
    assert cut.stop_reason == "max_tokens" and cut.content[0].type == "text"
    assert client.messages.create(**params("doc [fault:refusal]")).stop_reason == "refusal"  # type: ignore[arg-type]
    with pytest.raises(RateLimitError):
        client.messages.create(**params("doc [fault:429x1]"))  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="prompt is too long"):
        client.messages.create(**params("doc [fault:context]"))  # type: ignore[arg-type]


def test_anthropic_message_batches_results_by_custom_id_out_of_order(server: BatchServer) -> None:
    from anthropic import Anthropic, BadRequestError

    client = Anthropic(base_url=server.root, api_key="test", max_retries=0)
    requests = [{"custom_id": f"k{i}", "params": params(f"doc {i}")} for i in range(20)]
    requests.append({"custom_id": "bad", "params": params("x [fault:500x1]")})
    batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 21
    assert [client.messages.batches.retrieve(batch.id).processing_status for _ in range(2)] == ["in_progress"] * 2
    done = client.messages.batches.retrieve(batch.id)
    assert done.processing_status == "ended" and done.results_url
    assert (done.request_counts.succeeded, done.request_counts.errored) == (20, 1)
    out = list(client.messages.batches.results(batch.id))
    ids = [r.custom_id for r in out]
    assert sorted(ids) == sorted([f"k{i}" for i in range(20)] + ["bad"]) and ids != [r["custom_id"] for r in requests]
    kinds = {r.custom_id: r.result.type for r in out}
    assert kinds["bad"] == "errored" and {kinds[f"k{i}"] for i in range(20)} == {"succeeded"}
    succeeded = [r.result.message for r in out if r.result.type == "succeeded"]
    assert server.billed == [sum(m.usage.input_tokens for m in succeeded), sum(m.usage.output_tokens for m in succeeded)]
    assert [b.id for b in client.messages.batches.list()] == [batch.id]

    server.polls, server.expire_next = 0, 1
    expired = client.messages.batches.create(requests=requests[:2])  # type: ignore[arg-type]
    assert client.messages.batches.retrieve(expired.id).request_counts.expired == 2
    assert {r.result.type for r in client.messages.batches.results(expired.id)} == {"expired"}
    server.polls = 5
    cancelled = client.messages.batches.cancel(client.messages.batches.create(requests=requests[:1]).id)  # type: ignore[arg-type]
    assert cancelled.processing_status == "ended" and cancelled.cancel_initiated_at is not None
    assert [r.result.type for r in client.messages.batches.results(cancelled.id)] == ["canceled"]
    server.fail_next = 1
    with pytest.raises(BadRequestError):
        client.messages.batches.create(requests=requests[:1])  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="duplicate"):
        client.messages.batches.create(requests=[requests[0], requests[0]])  # type: ignore[arg-type]
    assert server.lines_received == 21 + 2 + 1
