"""The LLM boundary: one async method, requests and responses as plain data.

A backend turns a :class:`LLMRequest` into a :class:`LLMResponse` or raises an
:mod:`etl.errors` ``LLMError``. It does not validate against the output model — the runner does that
for every backend, always (invariant 4) — but it must apply the JSON schema as a constraint where it
can, and say in ``structured`` whether it did.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Message = dict[str, str]
FinishReason = Literal["stop", "length", "refusal", "error"]


@dataclass(frozen=True)
class LLMRequest:
    """What to ask: chat messages, the JSON schema the answer must match, and a token limit."""

    messages: list[Message]
    json_schema: dict[str, Any]
    max_tokens: int = 256
    #: Which answer this is, stable across runs: the stage's cache key (a repair's own id after an
    #: invalid answer). A batch backend sends it as the request's ``custom_id``.
    key: str | None = None


@dataclass(frozen=True)
class LLMResponse:
    """What came back, as the provider reported it."""

    text: str
    model: str
    tokens_in: int
    tokens_out: int
    finish_reason: FinishReason = "stop"
    confidence: float | None = None
    latency_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: Earlier sends of this request the provider received and never answered (a batch's errored
    #: or expired lines, sent again by the backend itself): attempts too, recorded at no cost.
    unanswered: int = 0
    #: The answer's tokens as ``(piece, logprob)`` in order, where the backend reports them: each
    #: field's confidence is read from them (``etl.confidence``).
    token_logprobs: tuple[tuple[str, float], ...] = ()


class LLM(ABC):
    """A model backend.

    ``model_id`` and ``params`` are part of every stage fingerprint: anything that can change an
    answer for the same prompt must appear in one of them, and nothing else should.
    """

    model_id: str
    params: dict[str, Any]
    #: USD per million tokens (input, output); used for cost accounting and cache savings.
    price_per_mtok: tuple[float, float] = (0.0, 0.0)
    #: Tokens the model reads and writes per call, where known: sizes a chunked stage's chunks.
    context_tokens: int | None = None

    @abstractmethod
    async def generate(self, request: LLMRequest) -> LLMResponse:
        """Answers one request.

        Called concurrently by the runner (up to its in-flight limit); a backend that cannot run
        requests in parallel serialises them itself. Raises ``TransientLLMError`` for failures worth
        retrying and ``OutputError`` subclasses when the answer itself is unusable. Nothing is
        committed for a document until every stage has answered, so a failure here loses nothing.
        """

    def token_counter(self) -> Callable[[str], int] | None:
        """The number of tokens the model reads a text as, where the backend knows its tokenizer
        (sizes long documents' chunks); None: 4 characters a token is assumed."""
        return None

    async def aclose(self) -> None:
        """Releases the model or connections; called once when the run ends (not after a crash)."""

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        price_in, price_out = self.price_per_mtok
        return (tokens_in * price_in + tokens_out * price_out) / 1_000_000
