"""The LLM boundary: one async method, requests and responses as plain data.

A backend turns a :class:`LLMRequest` into a :class:`LLMResponse` or raises an
:mod:`etl.errors` ``LLMError``. It does not validate against the output model — the runner does that
for every backend, always (invariant 4) — but it must apply the JSON schema as a constraint where it
can, and say in ``structured`` whether it did.
"""

from __future__ import annotations

import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

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


class ModelAliasWarning(UserWarning):
    """A model name the provider may point at a new snapshot: answers can change under the same
    name (and fingerprint). Pin a dated snapshot; ``etl drift`` raises ``model_version`` when the
    version a provider reports changes."""


_OPENAI_FAMILIES = re.compile(r"^(gpt-|chatgpt-|o\d)")
_OPENAI_DATED = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{4})(-preview)?$")  # gpt-4o-mini-2024-07-18, gpt-4-0613
_ANTHROPIC_DATED = re.compile(r"-\d{8}(-v\d+(:\d+)?)?$")  # claude-sonnet-4-5-20250929
_LATEST = re.compile(r"(^|[-:_./@])latest$")


def alias_problem(model: str, base_url: str) -> str | None:
    """Why ``model`` at ``base_url`` is an alias rather than a pinned snapshot, or None. Any
    provider's ``…-latest``; OpenAI's models without their date (``gpt-4o-mini`` is
    ``gpt-4o-mini-2024-07-18`` today); Anthropic's without theirs. Self-hosted names are the user's."""
    name, host = model.strip().lower(), (urlsplit(base_url).hostname or "").lower()
    if _LATEST.search(name):
        why = "names whatever the provider calls latest"
    elif host == "api.openai.com" and _OPENAI_FAMILIES.match(name) and not _OPENAI_DATED.search(name):
        why = "is an OpenAI alias that moves to new dated snapshots (e.g. gpt-4o-mini → gpt-4o-mini-2024-07-18)"
    elif host == "api.anthropic.com" and name.startswith("claude") and not _ANTHROPIC_DATED.search(name):
        why = "is an Anthropic alias that moves to new dated snapshots (e.g. claude-sonnet-4-5-20250929)"
    else:
        return None
    return (f"model {model!r} {why}: its answers can change under the same name and fingerprint; pin a dated "
            "snapshot (etl drift reports model_version when the version the provider reports changes)")


def warn_if_alias(model: str, base_url: str) -> None:
    if (problem := alias_problem(model, base_url)) is not None:
        warnings.warn(problem, ModelAliasWarning, stacklevel=3)
