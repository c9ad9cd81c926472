"""Anthropic's Messages API over HTTP (``/v1/messages``), with structured output by a forced tool.

The schema is the input schema of one tool, ``output``, that the model must call
(``tool_choice={"type": "tool", "name": "output"}``); its input is the answer. A text answer
instead (prose, or JSON cut off at ``max_tokens``) is passed on as text, and the runner's
validation decides, as for every backend. ``etl run --batch`` sends the same request bodies through
Message Batches (``etl.llm.batch``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from pydantic import SecretStr

from etl.errors import ContextOverflow, LLMError, LLMTimeout, RateLimited, TransientLLMError
from etl.llm.base import LLM, LLMRequest, LLMResponse, warn_if_alias
from etl.llm.openai_compat import _retry_after
from etl.llm.ratelimit import RateLimit

VERSION = "2023-06-01"
TOOL = "output"


class AnthropicLLM(LLM):
    """A Claude model.

    Args:
        model: e.g. ``claude-haiku-4-5``.
        api_key: Sent as ``x-api-key``; never logged.
        base_url: ``https://api.anthropic.com`` (paths start with ``/v1``).
        price_per_mtok: USD per million (input, output) tokens, for cost accounting.
        requests_per_s, tokens_per_min: A client-side rate limit.
    """

    def __init__(self, model: str, *, api_key: SecretStr | str | None = None,
                 base_url: str = "https://api.anthropic.com", timeout_s: float = 60.0,
                 price_per_mtok: tuple[float, float] = (0.0, 0.0), requests_per_s: float | None = None,
                 tokens_per_min: float | None = None, temperature: float = 0.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.model_id = f"{model}@{self.base_url}"
        warn_if_alias(model, self.base_url)
        self.params = {"temperature": temperature, "structured": "tool"}
        self.price_per_mtok = price_per_mtok
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self.api_key = SecretStr(key or "")
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers={
            "x-api-key": key or "", "anthropic-version": VERSION})
        self._limit = RateLimit(requests_per_s, tokens_per_min)

    def _body(self, request: LLMRequest) -> dict[str, Any]:
        """The Messages API's parameters for ``request`` (a batch line's ``params`` too)."""
        system = "\n\n".join(m["content"] for m in request.messages if m["role"] == "system")
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": request.max_tokens, "temperature": self.params["temperature"],
            "messages": [{"role": m["role"], "content": m["content"]} for m in request.messages if m["role"] != "system"],
            "tools": [{"name": TOOL, "description": "Record the answer.", "input_schema": request.json_schema}],
            "tool_choice": {"type": "tool", "name": TOOL},
        }
        if system:
            body["system"] = system
        return body

    async def generate(self, request: LLMRequest) -> LLMResponse:
        body = self._body(request)
        await self._limit.acquire(sum(len(m["content"]) for m in request.messages) // 4 + request.max_tokens)
        started = time.perf_counter()
        try:
            response = await self._client.post("/v1/messages", json=body)
        except httpx.TimeoutException as exc:
            raise LLMTimeout(f"no answer from {self.base_url} in time") from exc
        except httpx.TransportError as exc:
            raise TransientLLMError(f"connection to {self.base_url} failed: {type(exc).__name__}") from exc
        latency_ms = (time.perf_counter() - started) * 1000
        if response.status_code == 429:
            raise RateLimited("rate limited (429)", retry_after=_retry_after(response))
        if response.status_code >= 500 or response.status_code in (408, 529):
            raise TransientLLMError(f"provider error {response.status_code}", retry_after=_retry_after(response))
        if response.status_code >= 400:
            raise refused(response.status_code, response.text)
        try:
            payload = response.json()
        except ValueError as exc:
            raise TransientLLMError(f"malformed response from {self.base_url}") from exc
        return self.answer(payload, latency_ms)

    def answer(self, payload: Any, latency_ms: float) -> LLMResponse:
        """A Message as an answer: the forced tool's input, else its text (a batch's succeeded
        results carry the same Message)."""
        try:
            blocks = payload["content"]
            tool = next((b for b in blocks if b.get("type") == "tool_use" and b.get("name") == TOOL), None)
            text = json.dumps(tool["input"]) if tool is not None else "".join(
                b.get("text") or "" for b in blocks if b.get("type") == "text")
        except (KeyError, TypeError, AttributeError) as exc:
            raise TransientLLMError(f"malformed response from {self.base_url}") from exc
        usage = payload.get("usage") or {}
        stop = payload.get("stop_reason")
        return LLMResponse(
            text=text,
            model=payload.get("model") or self.model,
            tokens_in=int(usage.get("input_tokens") or 0),
            tokens_out=int(usage.get("output_tokens") or 0),
            finish_reason="refusal" if stop == "refusal" else "length" if stop == "max_tokens" else "stop",
            latency_ms=latency_ms,
            extra={"structured": "tool" if tool is not None else "none"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def refused(status: int | None, text: str) -> LLMError:
    """The error for a request the provider refused (4xx): sending it again cannot help."""
    text = text[:300]
    if "prompt is too long" in text.lower() or "context" in text.lower() and "window" in text.lower():
        return ContextOverflow(f"prompt too long: {text}")
    return LLMError(f"provider refused the request ({status}): {text}")
