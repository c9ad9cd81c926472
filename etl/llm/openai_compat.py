"""OpenAI-compatible chat completions over HTTP: OpenAI, vLLM, Ollama, llama.cpp's server.

Structured-output modes, by what the server accepts:
- ``json_schema``: ``response_format={"type": "json_schema", "json_schema": {..., "strict": true}}``
  (OpenAI, vLLM, Ollama);
- ``json_object``: ``response_format={"type": "json_object", "schema": ...}`` (llama.cpp's server,
  which turns the schema into a grammar);
- ``none``: plain text; the schema goes into the prompt and validation does the rest.
Whatever the mode, the runner validates every answer.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import httpx
from pydantic import SecretStr

from etl.confidence import pieces_from_bytes
from etl.errors import ContextOverflow, LLMError, LLMTimeout, RateLimited, TransientLLMError
from etl.llm.base import LLM, LLMRequest, LLMResponse, warn_if_alias
from etl.llm.ratelimit import RateLimit

StructuredMode = Literal["json_schema", "json_object", "none"]


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from model providers; fall back to backoff


class OpenAICompatibleLLM(LLM):
    """A chat-completions endpoint.

    Args:
        base_url: e.g. ``https://api.openai.com/v1`` or ``http://127.0.0.1:8000/v1``.
        model: The model name to request (the provider's answer reports the exact version).
        api_key: Sent as a bearer token; never logged.
        structured: How the schema is enforced server-side (see the module docstring).
        price_per_mtok: USD per million (input, output) tokens, for cost accounting.
        requests_per_s, tokens_per_min: A client-side rate limit for this provider.
        logprobs: Ask for the answer's token log-probabilities (``"logprobs": true``), from which
            each field's confidence is read; off by default, as some servers and models refuse it.
            llama.cpp's server (started with ``--logits_all true``) reports the model's own
            distribution before its grammar, so its confidences run lower than in-process LocalLLM's.
    """

    def __init__(self, base_url: str, model: str, *, api_key: SecretStr | str | None = None,
                 structured: StructuredMode = "json_schema", timeout_s: float = 60.0,
                 price_per_mtok: tuple[float, float] = (0.0, 0.0), requests_per_s: float | None = None,
                 tokens_per_min: float | None = None, temperature: float = 0.0, logprobs: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.model_id = f"{model}@{self.base_url}"
        warn_if_alias(model, self.base_url)
        self.structured = structured
        self.logprobs = logprobs
        self.params = {"temperature": temperature, "structured": structured}
        if logprobs:  # it changes what is cached (a confidence per value), so it is in the fingerprint
            self.params["logprobs"] = True
        self.price_per_mtok = price_per_mtok
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self.api_key = SecretStr(key or "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self._limit = RateLimit(requests_per_s, tokens_per_min)

    def _body(self, request: LLMRequest) -> dict[str, Any]:
        messages = list(request.messages)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": request.max_tokens,
                                "temperature": self.params["temperature"]}
        if self.logprobs:  # top_logprobs too: llama.cpp's server reports none without it
            body["logprobs"], body["top_logprobs"] = True, 0
        if self.structured == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": request.json_schema, "strict": True}}
        elif self.structured == "json_object":
            body["response_format"] = {"type": "json_object", "schema": request.json_schema}
        else:
            schema = json.dumps(request.json_schema, separators=(",", ":"))
            body["messages"] = [*messages[:-1], {"role": "system", "content": f"Reply with JSON matching: {schema}"},
                                messages[-1]]
        return body

    async def generate(self, request: LLMRequest) -> LLMResponse:
        body = self._body(request)
        await self._limit.acquire(sum(len(m["content"]) for m in body["messages"]) // 4 + request.max_tokens)
        started = time.perf_counter()
        try:
            response = await self._client.post("/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise LLMTimeout(f"no answer from {self.base_url} in time") from exc
        except httpx.TransportError as exc:
            raise TransientLLMError(f"connection to {self.base_url} failed: {type(exc).__name__}") from exc
        latency_ms = (time.perf_counter() - started) * 1000
        if response.status_code == 429:
            raise RateLimited("rate limited (429)", retry_after=_retry_after(response))
        if response.status_code >= 500 or response.status_code == 408:
            raise TransientLLMError(f"provider error {response.status_code}", retry_after=_retry_after(response))
        if response.status_code >= 400:
            text = response.text[:300]
            if "context" in text.lower() and ("length" in text.lower() or "window" in text.lower()):
                raise ContextOverflow(f"prompt too long for {self.model}: {text}")
            raise LLMError(f"provider refused the request ({response.status_code}): {text}")
        try:
            payload = response.json()
        except ValueError as exc:
            raise TransientLLMError(f"malformed response from {self.base_url}") from exc
        return self.answer(payload, latency_ms)

    def answer(self, payload: Any, latency_ms: float) -> LLMResponse:
        """A chat completion's body as an answer (a batch's result lines carry the same body)."""
        try:
            choice = payload["choices"][0]
            message = choice.get("message") or {}
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise TransientLLMError(f"malformed response from {self.base_url}") from exc
        usage = payload.get("usage") or {}
        refused = bool(message.get("refusal")) or choice.get("finish_reason") == "content_filter"
        finish = "refusal" if refused else "length" if choice.get("finish_reason") == "length" else "stop"
        return LLMResponse(  # a refusal is an answer too: it is parsed (and billed) like one
            text=(message.get("refusal") or message.get("content") or "") if refused else (message.get("content") or ""),
            model=payload.get("model") or self.model,
            tokens_in=int(usage.get("prompt_tokens") or 0),
            tokens_out=int(usage.get("completion_tokens") or 0),
            finish_reason=finish,
            latency_ms=latency_ms,
            extra={"structured": self.structured, "system_fingerprint": payload.get("system_fingerprint")},
            token_logprobs=_token_logprobs(choice),
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def _token_logprobs(choice: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """``choices[0].logprobs.content[]``'s ``(token, logprob)``; nothing where it is missing or
    malformed (a confidence is never guessed from a shape we do not know). Where every item gives
    its ``bytes``, pieces are decoded from them, so a character split across tokens (which each
    ``token`` string spells as a fragment) lands on the token that completes it."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list):
        return ()
    tokens, raw = [], []
    for item in content:
        token, logprob = (item.get("token"), item.get("logprob")) if isinstance(item, dict) else (None, None)
        if not isinstance(token, str) or isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            return ()
        tokens.append((token, float(logprob)))
        given = item.get("bytes")
        raw.append(bytes(given) if isinstance(given, list) and all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in given) else None)
    if tokens and all(b is not None for b in raw):
        return pieces_from_bytes((b, logprob) for b, (_, logprob) in zip(raw, tokens, strict=True))
    return tuple(tokens)