"""Fakes that ship with idem-etl, for tests of pipelines that must not need a real model.

``FakeLLM`` stands in for a *remote* model only: deterministic answers, scriptable latency and
faults, and a record of every call, so a test can assert "the second run made zero calls".
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dedup import sha256_hex
from etl.llm.base import LLM, LLMRequest, LLMResponse

Answer = Callable[[LLMRequest], str | dict[str, Any]]
Fault = Callable[[LLMRequest, int], Exception | None]


def _fill(schema: dict[str, Any], seed: str, defs: dict[str, Any]) -> Any:
    """A deterministic value that matches a JSON schema (the subset pydantic models produce)."""
    if "$ref" in schema:
        return _fill(defs[schema["$ref"].split("/")[-1]], seed, defs)
    if "enum" in schema:
        return schema["enum"][int(sha256_hex(seed), 16) % len(schema["enum"])]
    if "anyOf" in schema:
        return _fill(next(s for s in schema["anyOf"] if s.get("type") != "null"), seed, defs)
    kind = schema.get("type")
    if kind == "object":
        return {name: _fill(sub, f"{seed}/{name}", defs) for name, sub in schema.get("properties", {}).items()}
    if kind == "array":
        return [_fill(schema.get("items", {}), f"{seed}/0", defs)]
    if kind in ("number", "integer"):
        value = int(sha256_hex(seed)[:6], 16) % 1000
        return value if kind == "integer" else value / 10
    if kind == "boolean":
        return int(sha256_hex(seed)[:2], 16) % 2 == 0
    if schema.get("format") == "date":
        return "2024-01-%02d" % (int(sha256_hex(seed)[:2], 16) % 28 + 1)
    return f"value-{sha256_hex(seed)[:8]}"


def schema_answer(request: LLMRequest) -> dict[str, Any]:
    """The default answer: a valid object chosen by a hash of the prompt (same prompt, same answer)."""
    seed = json.dumps(request.messages, sort_keys=True)
    return _fill(request.json_schema, seed, request.json_schema.get("$defs", {}))


class FakeLLM(LLM):
    """A scripted model.

    Args:
        answer: Makes the answer text (or a dict, sent as JSON) for a request.
        latency_s: Seconds per call, or a callable drawing one (e.g. :func:`lognormal`).
        fault: Called with (request, call number); an exception it returns is raised instead of
            answering (e.g. a ``TransientLLMError`` for the first two calls).
        model_id: What the fingerprint and provenance record; change it to simulate a new model.
        reported: The model version the provider reports answering with (default: ``model_id``);
            change it under the same ``model_id`` to simulate an alias the provider moved.
        call_log: A file that gets one line per call (the prompt's hash), appended atomically, so
            calls can be counted across processes that are killed before they commit anything.
        logprobs: Makes the answer's ``(piece, logprob)`` tokens from (request, answer text), for
            tests of per-field confidence (:func:`value_logprobs` gives each value a probability).
    """

    def __init__(self, answer: Answer = schema_answer, *, latency_s: float | Callable[[], float] = 0.0,
                 fault: Fault | None = None, model_id: str = "fake-llm", tokens: tuple[int, int] = (100, 20),
                 price_per_mtok: tuple[float, float] = (0.0, 0.0), call_log: str | Path | None = None,
                 logprobs: Callable[[LLMRequest, str], Sequence[tuple[str, float]]] | None = None,
                 reported: str | None = None) -> None:
        self.answer = answer
        self.reported = reported
        self.latency_s = latency_s
        self.fault = fault
        self.model_id = model_id
        self.params = {"temperature": 0}
        self.tokens = tokens
        self.price_per_mtok = price_per_mtok
        self.call_log = Path(call_log) if call_log else None
        self.logprobs = logprobs
        self.calls: list[LLMRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, request: LLMRequest) -> LLMResponse:
        number = len(self.calls)
        self.calls.append(request)
        if self.call_log is not None:
            line = (sha256_hex(json.dumps(request.messages, sort_keys=True)) + "\n").encode()
            fd = os.open(self.call_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write(2) on O_APPEND: lines never interleave
            finally:
                os.close(fd)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            delay = self.latency_s() if callable(self.latency_s) else self.latency_s
            if delay:
                await asyncio.sleep(delay)
            if self.fault is not None and (error := self.fault(request, number)) is not None:
                raise error
            answer = self.answer(request)
            text = answer if isinstance(answer, str) else json.dumps(answer)
            return LLMResponse(text=text, model=self.reported or self.model_id, tokens_in=self.tokens[0], tokens_out=self.tokens[1],
                               latency_ms=delay * 1000,
                               token_logprobs=tuple(self.logprobs(request, text)) if self.logprobs else ())
        finally:
            self.in_flight -= 1


def value_logprobs(probability: Callable[[LLMRequest, str], float]
                   ) -> Callable[[LLMRequest, str], list[tuple[str, float]]]:
    """FakeLLM's ``logprobs=``: each scalar of the answer one token with the log of
    ``probability(request, path)``, the JSON around them tokens of probability 1."""
    from etl.confidence import value_ranges  # noqa: PLC0415

    def tokens(request: LLMRequest, text: str) -> list[tuple[str, float]]:
        out, at = [], 0
        for path, (start, end) in sorted(value_ranges(text).items(), key=lambda item: item[1]):
            if start > at:
                out.append((text[at:start], 0.0))
            out.append((text[start:end], math.log(max(1e-9, min(1.0, probability(request, path))))))
            at = end
        if at < len(text):
            out.append((text[at:], 0.0))
        return out

    return tokens


def simulated_labeller(gold: dict[str, str], labels: list[str], accuracy: float = 0.92,
                       partners: dict[str, str] | None = None, seed: str = "") -> Answer:
    """A simulated classifier for a Classify stage: the same answer every time for the same text
    (drawn from a hash of it and ``seed``), the gold label on ``accuracy`` of the texts.

    Errors fall on random texts with a random other label, or, with ``partners`` (label → the label
    it is confused with), only on texts of those labels, which get their partner: then
    ``accuracy`` is reached by erring on a larger share of those texts.
    Texts it has no gold label for get a label drawn from their hash."""
    share = 1.0 - accuracy
    if partners:
        covered = sum(label in partners for label in gold.values())
        share = min(1.0, (1.0 - accuracy) * len(gold) / max(covered, 1))

    def answer(request: LLMRequest) -> dict[str, Any]:
        text = request.messages[-1]["content"]
        draw = int(sha256_hex(f"{seed}:{text}")[:12], 16) / 16**12
        truth = gold.get(text)
        if truth is None:
            return {"label": labels[int(draw * len(labels))]}
        if partners:
            wrong = truth in partners and draw < share
            return {"label": partners[truth] if wrong else truth}
        if draw >= share:
            return {"label": truth}
        others = [label for label in labels if label != truth]
        return {"label": others[int(draw / share * len(others)) % len(others)]}

    return answer


def unstable(answer: Answer, share: float, other: Callable[[dict[str, Any]], dict[str, Any]], seed: int = 0) -> Answer:
    """``answer`` made unstable, as a provider at temperature 0 is: on ``share`` of the texts (drawn
    from a hash of each), every call gives ``answer``'s reply or ``other`` of it at even odds (draws
    from a generator seeded with ``seed``, so a test is repeatable). Stated instability: K answers
    to a document agree on ``1 - share + share * 2 ** (1 - K)`` of the documents, and two answers
    differ on ``share / 2`` of the pairs."""
    rng = random.Random(seed)

    def wobbly(request: LLMRequest) -> Any:
        reply = answer(request)
        reply = json.loads(reply) if isinstance(reply, str) else reply
        draw = int(sha256_hex(f"unstable:{seed}:{request.messages[-1]['content']}")[:12], 16) / 16**12
        return other(reply) if draw < share and rng.random() < 0.5 else reply

    return wobbly


def lognormal(median_s: float, sigma: float = 0.5, seed: int = 0) -> Callable[[], float]:
    """Latencies with the long right tail real providers have."""
    rng = random.Random(seed)
    return lambda: rng.lognormvariate(0, sigma) * median_s


__all__ = ["FakeLLM", "lognormal", "schema_answer", "simulated_labeller", "unstable"]
