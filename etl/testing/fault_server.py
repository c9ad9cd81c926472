"""An OpenAI-wire chat-completions server with scripted faults, on 127.0.0.1, for tests.

Each request's document (the last user message of the first turn) may carry directives that script
what this server does with it, counted per document across attempts:

- ``[fault:429x2]`` the first 2 attempts get 429 with ``Retry-After``; then a normal answer.
- ``[fault:500x9]`` the first 9 attempts get 500.        ``[fault:slowx2]`` the first 2 hang past timeouts.
- ``[fault:truncated]`` an answer cut off at the token limit (``finish_reason: "length"``).
- ``[fault:refusal]`` a refusal (``message.refusal``).     ``[fault:prose]`` JSON wrapped in chatter.
- ``[fault:invalid_once]`` one schema-invalid answer, then valid ones (a repair fixes it).
- ``[fault:invalid]`` always schema-invalid.               ``[fault:negative]`` every number is -5.
- ``[fault:context]`` 400 "maximum context length exceeded".
Otherwise it answers a valid object for the requested JSON schema, deterministically.
``heal()`` turns every fault off (the provider is fixed).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dedup import sha256_hex
from etl.llm.base import LLMRequest
from etl.testing.fakes import schema_answer

_DIRECTIVE = re.compile(r"\[fault:([a-z0-9_]+?)(?:x(\d+))?\]")


class FaultServer:
    """Start with ``with FaultServer() as server:``; ``server.url`` is the base URL (``.../v1``)."""

    def __init__(self, retry_after_s: float = 0.05, slow_s: float = 2.0) -> None:
        self.retry_after_s = retry_after_s
        self.slow_s = slow_s
        self.healed = False
        self.attempts: Counter[str] = Counter()
        self.requests = 0
        self.tokens_served = [0, 0]  # (prompt, completion) tokens reported in 200 answers
        self._lock = threading.Lock()
        ThreadingHTTPServer.request_queue_size = 256  # a busy client opens many connections at once
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()

    def heal(self) -> None:
        self.healed = True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, headers, payload = server.respond(body)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout): exactly what a slow provider causes

        return Handler

    def respond(self, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
        messages = body["messages"]
        document = next((m["content"] for m in messages if m["role"] == "user"), "")
        doc_id = sha256_hex(document)
        with self._lock:
            self.requests += 1
            self.attempts[doc_id] += 1
            attempt = self.attempts[doc_id]
        match = None if self.healed else _DIRECTIVE.search(document)
        fault, times = (match.group(1), int(match.group(2) or 1)) if match else (None, 0)
        if fault == "429" and attempt <= times:
            return 429, {"Retry-After": str(self.retry_after_s)}, {"error": {"message": "rate limited"}}
        if fault == "500" and attempt <= times:
            return 500, {}, {"error": {"message": "internal error"}}
        late = fault == "slow" and attempt <= times
        if late:
            time.sleep(self.slow_s)  # the client has given up by now; its answer is never seen
        if fault == "context":
            return 400, {}, {"error": {"message": "This model's maximum context length is 128 tokens"}}
        schema = self._schema(body)
        answer = schema_answer(LLMRequest(messages=[{"role": "user", "content": document}], json_schema=schema))
        if fault == "negative":
            answer = {k: (-5 if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in answer.items()}
        text = json.dumps(answer)
        finish = "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if fault == "truncated":
            text, finish = text[: len(text) // 2], "length"
            message["content"] = text
        elif fault == "refusal":
            message = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
        elif fault == "prose":
            message["content"] = f"Sure! Here is the JSON you asked for:\n{text}\nLet me know if you need more."
        elif fault == "invalid" or (fault == "invalid_once" and attempt == 1):
            message["content"] = json.dumps({"unexpected": "shape"})
        prompt_tokens = sum(len(m.get("content") or "") for m in messages) // 4 + 1
        completion_tokens = len(message.get("content") or "") // 4 + 1
        if not late:
            with self._lock:
                self.tokens_served[0] += prompt_tokens
                self.tokens_served[1] += completion_tokens
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if body.get("logprobs") and message.get("content"):
            # four-character tokens, each with the probability 0.9 (OpenAI's shape: content[].token/logprob)
            content = message["content"]
            choice["logprobs"] = {"content": [
                {"token": content[at:at + 4], "logprob": math.log(0.9), "bytes": list(content[at:at + 4].encode()),
                 "top_logprobs": []} for at in range(0, len(content), 4)], "refusal": None}
        return 200, {}, {
            "id": f"chatcmpl-{self.requests}", "object": "chat.completion", "model": "fault-model-2026-01",
            "system_fingerprint": "fp_fault_1",
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    @staticmethod
    def _schema(body: dict[str, Any]) -> dict[str, Any]:
        fmt = body.get("response_format") or {}
        if fmt.get("type") == "json_schema":
            return fmt["json_schema"]["schema"]  # type: ignore[no-any-return]
        if fmt.get("type") == "json_object" and "schema" in fmt:
            return fmt["schema"]  # type: ignore[no-any-return]
        for m in body["messages"]:
            if m["role"] == "system" and m["content"].startswith("Reply with JSON matching: "):
                return json.loads(m["content"].removeprefix("Reply with JSON matching: "))  # type: ignore[no-any-return]
        return {"type": "object", "properties": {}}
