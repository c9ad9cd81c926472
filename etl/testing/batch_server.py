"""A batch server for tests on 127.0.0.1, speaking two wires: OpenAI's Files (``purpose=batch``) and
``/v1/batches``, and Anthropic's Messages (``/v1/messages``) and Message Batches
(``/v1/messages/batches``). ``url`` is the OpenAI base URL (``.../v1``), ``root`` Anthropic's.

Each line of a batch is answered as :class:`~etl.testing.fault_server.FaultServer` answers a chat request
(its ``[fault:...]`` directives included: ``[fault:500x1]`` makes that line an errored one), and
results come back the way the provider returns them: in an output file and an error file, keyed by
``custom_id``, in no particular order. Whole-batch behaviour is scripted on the server:

- ``polls``: a batch is ``in_progress`` for this many retrievals before it completes;
- ``expire_next`` / ``fail_next``: the next batches created expire (every line not yet done goes to
  the error file as ``batch_expired``; Anthropic: an ``expired`` result) or fail validation
  (``status: failed``, no files; Anthropic refuses the create with a 400);
- ``duplicate_lines`` / ``unknown_lines``: the output file repeats a line and adds one for a
  ``custom_id`` that was never sent.

It counts everything: every HTTP request, every batch line it received, the tokens it billed.
``on_request``, if set, is called with the moment a request reached, on the server's thread, so a
crash test can kill its client exactly there: ``"upload"`` (a file received, before the reply;
Anthropic: a batch's requests received, before it is made),
``"create"`` (the batch made, before the reply: the client never learns its id), ``"poll"``,
``"download"`` (before a result file is sent) and ``"downloaded"`` (after: the client commits next).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import random
import re
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler
from typing import Any

from etl.testing.fault_server import FaultServer


class BatchServer(FaultServer):
    """Start with ``with BatchServer() as server:``; ``server.url`` is the base URL (``.../v1``)."""

    def __init__(self, *, polls: int = 0, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.polls = polls
        self.expire_next = 0
        self.fail_next = 0
        self.duplicate_lines = False
        self.unknown_lines = False
        self.http_requests = 0
        self.lines_received = 0
        self.billed = [0, 0]  # (prompt, completion) tokens of the lines answered in batches
        self.files: dict[str, tuple[str, bytes]] = {}  # id -> (purpose, content)
        self.batches: dict[str, dict[str, Any]] = {}
        self.message_batches: dict[str, dict[str, Any]] = {}  # Anthropic's
        self._requests: dict[str, list[dict[str, Any]]] = {}  # an Anthropic batch's requests
        self._results: dict[str, bytes] = {}  # an ended Anthropic batch's results JSONL
        self.root = self.url.removesuffix("/v1")
        self._polled: dict[str, int] = {}
        self._random = random.Random(seed)
        self._ids = 0
        self.on_request: Callable[[str], None] | None = None

    def _moment(self, name: str) -> None:
        if self.on_request is not None:
            self.on_request(name)

    # -- the wire -------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self
        chat = super()._handler()

        class Handler(chat):  # type: ignore[misc, valid-type]
            def _reply(self, status: int, payload: Any, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/octet-stream" if raw is not None else "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client is gone (killed by a crash test, or it gave up)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server._count()
                path = self.path.split("?")[0].removeprefix("/v1")
                if path.startswith("/files/") and path.endswith("/content"):
                    found = server.files.get(path.split("/")[2])
                    server._moment("download")
                    self._reply(200, None, found[1]) if found else self._reply(404, _error("no such file"))
                    server._moment("downloaded")
                elif path.startswith("/messages/batches"):
                    parts = path.split("/")  # "", messages, batches[, id[, results]]
                    if len(parts) == 3:
                        data = sorted(server.message_batches.values(), key=lambda b: b["created_at"], reverse=True)
                        self._reply(200, {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                          "last_id": data[-1]["id"] if data else None})
                    elif len(parts) == 5 and parts[4] == "results" and parts[3] in server._results:
                        server._moment("download")
                        self._reply(200, None, server._results[parts[3]])
                        server._moment("downloaded")
                    elif len(parts) == 4 and parts[3] in server.message_batches:
                        server._moment("poll")
                        self._reply(200, server.retrieve_message_batch(parts[3]))
                    else:
                        self._reply(404, _anthropic_error("not_found_error", f"unknown path {path}"))
                elif path == "/batches":
                    data = sorted(server.batches.values(), key=lambda b: -b["created_at"])
                    self._reply(200, {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                      "last_id": data[-1]["id"] if data else None, "has_more": False})
                elif path.startswith("/batches/"):
                    server._moment("poll")
                    batch = server.retrieve(path.split("/")[2])
                    self._reply(200, batch) if batch else self._reply(404, _error("no such batch"))
                else:
                    self._reply(404, _error(f"unknown path {path}"))

            def do_POST(self) -> None:  # noqa: N802
                path = self.path.split("?")[0].removeprefix("/v1")
                if path == "/chat/completions":
                    super().do_POST()  # the synchronous endpoint, as FaultServer serves it
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path == "/messages":
                    status, payload = server.respond_anthropic(json.loads(body))
                    self._reply(status, payload)
                    return
                server._count()
                if path == "/messages/batches":
                    server._moment("upload")  # the requests arrived in the create itself; not made yet
                    status, payload = server.create_message_batch(json.loads(body))
                    server._moment("create")
                    self._reply(status, payload)
                elif path.startswith("/messages/batches/") and path.endswith("/cancel"):
                    batch_id = path.split("/")[3]
                    if batch_id in server.message_batches:
                        self._reply(200, server.cancel_message_batch(batch_id))
                    else:
                        self._reply(404, _anthropic_error("not_found_error", "no such batch"))
                elif path == "/files":
                    purpose, content = _multipart(self.headers["Content-Type"], body)
                    uploaded = server.add_file(purpose, content)
                    server._moment("upload")
                    self._reply(200, uploaded)
                elif path == "/batches":
                    status, payload = server.create(json.loads(body))
                    server._moment("create")
                    self._reply(status, payload)
                elif path.startswith("/batches/") and path.endswith("/cancel"):
                    batch = server.cancel(path.split("/")[2])
                    self._reply(200, batch) if batch else self._reply(404, _error("no such batch"))
                else:
                    self._reply(404, _error(f"unknown path {path}"))

        return Handler

    # -- what it does ---------------------------------------------------------------------------

    def _count(self) -> None:
        with self._lock:
            self.http_requests += 1

    def _id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}_{self._ids:06d}"

    def add_file(self, purpose: str, content: bytes) -> dict[str, Any]:
        file_id = self._id("file")
        self.files[file_id] = (purpose, content)
        return {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                "filename": "input.jsonl", "purpose": purpose, "status": "processed"}

    def create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        found = self.files.get(body.get("input_file_id", ""))
        if found is None or found[0] != "batch":
            return 400, _error("input_file_id is not a file with purpose batch")
        lines = [json.loads(line) for line in found[1].decode().splitlines() if line.strip()]
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": self._id("batch"), "object": "batch", "endpoint": body.get("endpoint"), "errors": None,
            "input_file_id": body["input_file_id"], "completion_window": body.get("completion_window", "24h"),
            "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + 86400, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": body.get("metadata"),
        }
        ids = [line.get("custom_id") for line in lines]
        with self._lock:
            self.lines_received += len(lines)
            failing = self.fail_next > 0
            self.fail_next -= failing
        if failing or len(set(ids)) != len(ids) or any(line.get("url") != body.get("endpoint") for line in lines):
            batch.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                {"code": "invalid_request", "message": "duplicate custom_id or a line for another endpoint"
                 if not failing else "the input file failed validation", "line": None, "param": None}]})
        self.batches[batch["id"]] = batch
        self._polled[batch["id"]] = 0
        return 200, batch

    def retrieve(self, batch_id: str) -> dict[str, Any] | None:
        batch = self.batches.get(batch_id)
        if batch is None or batch["status"] not in ("validating", "in_progress"):
            return batch
        self._polled[batch_id] += 1
        if self._polled[batch_id] <= self.polls:
            batch.update(status="in_progress", in_progress_at=batch["in_progress_at"] or int(time.time()))
            return batch
        with self._lock:
            expiring = self.expire_next > 0
            self.expire_next -= expiring
        self._finish(batch, expired=expiring)
        return batch

    def cancel(self, batch_id: str) -> dict[str, Any] | None:
        batch = self.batches.get(batch_id)
        if batch is not None and batch["status"] in ("validating", "in_progress"):
            self._finish(batch, expired=False, cancelled=True)
        return batch

    def _finish(self, batch: dict[str, Any], *, expired: bool, cancelled: bool = False) -> None:
        lines = [json.loads(line) for line in self.files[batch["input_file_id"]][1].decode().splitlines() if line]
        out, errors = [], []
        for number, line in enumerate(lines):
            record = {"id": f"batch_req_{batch['id']}_{number}", "custom_id": line["custom_id"]}
            if expired or cancelled:
                code = "batch_expired" if expired else "batch_cancelled"
                errors.append({**record, "response": None, "error": {"code": code, "message": f"{code}"}})
                continue
            status, _, payload = self.respond(line["body"])
            if status == 200:
                with self._lock:
                    self.billed[0] += payload["usage"]["prompt_tokens"]
                    self.billed[1] += payload["usage"]["completion_tokens"]
            target = out if status == 200 else errors
            target.append({**record, "response": {"status_code": status, "request_id": record["id"], "body": payload},
                           "error": None})
        self._random.shuffle(out)  # results come back in no particular order
        if self.duplicate_lines and out:
            out.append(out[0])
        if self.unknown_lines:
            out.append({"id": "batch_req_unknown", "custom_id": "never-sent", "error": None,
                        "response": {"status_code": 200, "request_id": "x", "body": {}}})
        now = int(time.time())
        if out:
            batch["output_file_id"] = self.add_file("batch_output", _jsonl(out))["id"]
        if errors:
            batch["error_file_id"] = self.add_file("batch_output", _jsonl(errors))["id"]
        state = "expired" if expired else "cancelled" if cancelled else "completed"
        batch.update(status=state, **{f"{state}_at": now}, request_counts={
            "total": len(lines), "completed": len(lines) - len(errors), "failed": len(errors)})


    # -- Anthropic's wire -----------------------------------------------------------------------

    def respond_anthropic(self, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A Messages API answer, as :meth:`respond` answers the same request on OpenAI's wire: the
        answer object as the input of the forced tool; prose, truncation and refusals as Anthropic
        reports them."""
        tools = params.get("tools") or [{}]
        messages = list(params.get("messages") or [])
        if params.get("system"):
            messages = [{"role": "system", "content": params["system"]}, *messages]
        status, _, payload = self.respond({"messages": messages, "response_format": {
            "type": "json_schema", "json_schema": {"schema": tools[0].get("input_schema") or {}}}})
        if status != 200:
            kind = {429: "rate_limit_error", 400: "invalid_request_error"}.get(status, "api_error")
            message = payload["error"]["message"]
            if "context length" in message:
                message = "prompt is too long: 200001 tokens > 200000 maximum"
            return status, _anthropic_error(kind, message)
        choice = payload["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        text = message.get("content") or ""
        if message.get("refusal"):
            content, stop = [], "refusal"
        elif finish == "length":
            content, stop = [{"type": "text", "text": text}], "max_tokens"
        else:
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            content, stop = ([{"type": "tool_use", "id": f"toolu_{self.requests:06d}", "name": tools[0].get("name"),
                               "input": answer}], "tool_use") if isinstance(answer, dict) else (
                [{"type": "text", "text": text}], "end_turn")
        return 200, {"id": f"msg_{self.requests:06d}", "type": "message", "role": "assistant",
                     "model": "fault-model-2026-01", "content": content, "stop_reason": stop, "stop_sequence": None,
                     "usage": {"input_tokens": payload["usage"]["prompt_tokens"],
                               "output_tokens": payload["usage"]["completion_tokens"]}}

    def create_message_batch(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        requests = list(body.get("requests") or [])
        ids = [r.get("custom_id") for r in requests]
        with self._lock:
            failing = self.fail_next > 0
            self.fail_next -= failing
        bad = next((i for i in ids if not isinstance(i, str) or not _CUSTOM_ID.fullmatch(i)), None)
        if failing or not requests or len(set(ids)) != len(ids) or bad is not None:
            return 400, _anthropic_error("invalid_request_error", "the batch failed validation" if failing else
                                         f"invalid or duplicate custom_id: {bad!r}" if requests else "no requests")
        with self._lock:
            self.lines_received += len(requests)
        now = datetime.now(timezone.utc)
        batch = {"id": self._id("msgbatch"), "type": "message_batch", "processing_status": "in_progress",
                 "request_counts": {"processing": len(requests), "succeeded": 0, "errored": 0, "canceled": 0,
                                    "expired": 0},
                 "ended_at": None, "created_at": _iso(now), "expires_at": _iso(now + timedelta(hours=24)),
                 "archived_at": None, "cancel_initiated_at": None, "results_url": None}
        self.message_batches[batch["id"]] = batch
        self._requests[batch["id"]] = requests
        self._polled[batch["id"]] = 0
        return 200, batch

    def retrieve_message_batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.message_batches[batch_id]
        if batch["processing_status"] == "ended":
            return batch
        self._polled[batch_id] += 1
        if self._polled[batch_id] <= self.polls:
            return batch
        with self._lock:
            expiring = self.expire_next > 0
            self.expire_next -= expiring
        self._end_message_batch(batch, "expired" if expiring else None)
        return batch

    def cancel_message_batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.message_batches[batch_id]
        if batch["processing_status"] != "ended":
            batch["cancel_initiated_at"] = _iso(datetime.now(timezone.utc))
            self._end_message_batch(batch, "canceled")
        return batch

    def _end_message_batch(self, batch: dict[str, Any], ending: str | None) -> None:
        results = []
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for request in self._requests[batch["id"]]:
            record: dict[str, Any] = {"custom_id": request["custom_id"]}
            if ending is not None:
                record["result"] = {"type": ending}
                counts[ending] += 1
            else:
                status, payload = self.respond_anthropic(request["params"])
                if status == 200:
                    with self._lock:
                        self.billed[0] += payload["usage"]["input_tokens"]
                        self.billed[1] += payload["usage"]["output_tokens"]
                    record["result"] = {"type": "succeeded", "message": payload}
                    counts["succeeded"] += 1
                else:
                    record["result"] = {"type": "errored", "error": payload}
                    counts["errored"] += 1
            results.append(record)
        self._random.shuffle(results)  # results come back in no particular order
        if self.duplicate_lines and results:
            results.append(results[0])
        if self.unknown_lines:
            results.append({"custom_id": "never-sent", "result": {"type": "succeeded", "message": {
                "content": [], "usage": {"input_tokens": 0, "output_tokens": 0}}}})
        self._results[batch["id"]] = _jsonl(results)
        batch.update(processing_status="ended", request_counts=counts, ended_at=_iso(datetime.now(timezone.utc)),
                     results_url=f"{self.root}/v1/messages/batches/{batch['id']}/results")


_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _anthropic_error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _multipart(content_type: str, body: bytes) -> tuple[str, bytes]:
    """(purpose, file content) of a multipart/form-data upload."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    purpose, content = "", b""
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name == "purpose":
            purpose = part.get_content().strip() if isinstance(part.get_content(), str) else part.get_content().decode()
        elif name == "file":
            content = part.get_payload(decode=True) or b""
    return purpose, content
