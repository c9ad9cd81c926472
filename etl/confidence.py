"""How sure the model was of each value it wrote, and whether that sureness can be trusted.

Per field, from one of two sources, always said which:

- ``logprob``: the probability the model gave the tokens that spell the value (the product over
  the tokens that overlap the value's characters in the answer's JSON text: a string's characters
  between its quotes, a number's digits), where
  the backend reports token log-probabilities (llama.cpp here, OpenAI with ``logprobs=True``). For a
  constrained decoder it is the probability under the constrained distribution.
- ``agreement``: for a long document's scalar fields without log-probabilities, the share of the
  chunks that gave a value which gave the merged one.

A field with neither has no confidence (``None``), never a made-up one. :func:`calibration` turns
(confidence, correct) pairs from the golden set into an expected calibration error and the bins of
a reliability diagram. Pure: text in, numbers out.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


#: A field's confidence as cached and stored: ``[probability, "logprob" | "agreement"]``.
Confidence = dict[str, list[Any]]


class _Scanner:
    """The character range of every scalar in a JSON text, by the path ``etl.grounding.leaves`` uses."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0
        self.ranges: dict[str, tuple[int, int]] = {}
        self._decoder = json.JSONDecoder()

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def value(self, path: str) -> None:
        self._space()
        char = self.text[self.at:self.at + 1]
        if char == "{":
            self.at += 1
            self._space()
            if self.text.startswith("}", self.at):
                self.at += 1
                return
            seen: set[str] = set()
            while True:
                self._space()
                name, self.at = self._decoder.raw_decode(self.text, self.at)
                self._space()
                if not self.text.startswith(":", self.at):
                    raise ValueError("expected ':'")
                self.at += 1
                inner = f"{path}.{name}" if path else str(name)
                if inner in seen:  # a repeated key: JSON readers keep its last value only
                    self.ranges = {p: r for p, r in self.ranges.items()
                                   if not (p == inner or p.startswith((inner + ".", inner + "[")))}
                seen.add(inner)
                self.value(inner)
                self._space()
                if self.text.startswith(",", self.at):
                    self.at += 1
                    continue
                if self.text.startswith("}", self.at):
                    self.at += 1
                    return
                raise ValueError("expected ',' or '}'")
        if char == "[":
            self.at += 1
            self._space()
            if self.text.startswith("]", self.at):
                self.at += 1
                return
            number = 0
            while True:
                self.value(f"{path}[{number}]")
                number += 1
                self._space()
                if self.text.startswith(",", self.at):
                    self.at += 1
                    continue
                if self.text.startswith("]", self.at):
                    self.at += 1
                    return
                raise ValueError("expected ',' or ']'")
        start = self.at
        _, self.at = self._decoder.raw_decode(self.text, self.at)
        self.ranges[path] = (start, self.at)


def value_ranges(text: str) -> dict[str, tuple[int, int]]:
    """``{path: (start, end)}`` of every scalar in the JSON ``text`` (a string's range includes its
    quotes); empty if the text is not one JSON value."""
    scanner = _Scanner(text)
    try:
        scanner.value("")
        scanner._space()
    except (ValueError, IndexError, RecursionError):
        return {}
    return scanner.ranges if scanner.at == len(text) else {}


def embedded_object(text: str) -> tuple[dict[str, Any], int, int] | None:
    """The first JSON object inside prose ("Sure! Here it is: {...} Hope that helps") and where it
    starts and ends, or None. Never an object nested in a broken one: after a brace that does not
    start valid JSON the search resumes past where decoding failed (a truncated answer's inner
    object is not the answer), and an object Python's json will not read (5,000 digits, nesting past
    the stack) ends the search."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            start = text.find("{", max(start + 1, exc.pos))
            continue
        except (ValueError, RecursionError):
            return None
        if isinstance(value, dict):
            return value, start, end
        start = text.find("{", start + 1)  # pragma: no cover - a "{" decodes to a dict or fails
    return None


def _answer_ranges(text: str) -> dict[str, tuple[int, int]]:
    """:func:`value_ranges` of the answer, or of the first JSON object inside it (a fenced or
    prose-wrapped answer, as ``Stage.parse`` reads it), in the answer's own offsets."""
    ranges = value_ranges(text)
    if ranges or (found := embedded_object(text)) is None:
        return ranges
    _, start, end = found
    return {path: (a + start, b + start) for path, (a, b) in value_ranges(text[start:end]).items()}


def from_logprobs(text: str, tokens: Sequence[tuple[str, float]], output: Any = None) -> Confidence:
    """Each scalar's probability from the answer's tokens (``(piece, logprob)`` in order, whose
    pieces spell ``text``, or spell it with surrounding space some servers strip). Empty when the
    pieces do not spell the text, or carry a log-probability that is not a finite number: then
    nothing is claimed. A value the pieces do not reach to its end (a last token not reported) gets
    none. With ``output`` (the validated answer as JSON data), only the values it holds unchanged at
    the same path, inside list items it holds unchanged, keep one: a validator that reorders, drops
    or rewrites a value, or a key the schema does not keep, must not carry the raw answer's
    confidence to another value. Total: an answer it cannot read claims nothing."""
    try:
        return _from_logprobs(text, tokens, output)
    except (ValueError, RecursionError):  # an answer nested deeper than the stack goes
        return {}


def _from_logprobs(text: str, tokens: Sequence[tuple[str, float]], output: Any) -> Confidence:
    spelled = "".join(piece for piece, _ in tokens)
    core = text.strip()
    found = spelled.find(core) if core else -1
    if found < 0 and spelled.strip() and core.startswith(spelled.strip()):  # the last tokens not reported
        found = len(spelled) - len(spelled.lstrip())
    if found < 0 or not all(math.isfinite(logprob) for _, logprob in tokens):
        return {}
    at = (len(text) - len(text.lstrip())) - found  # where the first piece starts, in text's offsets
    begins, stops, logprobs = [], [], []
    for piece, logprob in tokens:
        begins.append(at)
        at += len(piece)
        stops.append(at)
        logprobs.append(min(0.0, logprob))
    ranges = {path: span for path, span in _answer_ranges(text).items() if span[1] <= at}
    if output is not None:
        ranges = _unchanged(ranges, text, dict(scalars(output)))
    out: Confidence = {}
    for path, (start, end) in ranges.items():
        if text[start] == '"' and end - start > 2:  # a string's own characters, not the quotes' choice of
            start, end = start + 1, end - 1  # spacing around them (a token ' "' or '"}' is formatting)
        # the tokens overlapping [start, end): those ending after start and beginning before end
        total = sum(logprobs[bisect_right(stops, start):bisect_left(begins, end)])
        out[path] = [math.exp(total), "logprob"]
    return out


def scalars(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every scalar in JSON data, booleans and nulls included (the values a model
    chose tokens for), by the paths ``etl.grounding.leaves`` uses."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from scalars(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for number, item in enumerate(value):
            yield from scalars(item, f"{path}[{number}]")
    else:
        yield path, value


_ITEM = re.compile(r"\[\d+\]")


def _unchanged(ranges: dict[str, tuple[int, int]], text: str,
               validated: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The answer's values the validated output holds as they were: the same value at the same
    path, and no value of an enclosing list item changed (a list sorted by one field moves its
    items' other fields with them, however equal they look)."""
    kept = {path: _same(validated[path], text[start:end]) for path, (start, end) in ranges.items()
            if path in validated}  # a key the schema dropped changed nothing it kept
    moved = {path[:m.end()] for path, same in kept.items() if not same for m in _ITEM.finditer(path)}
    return {path: ranges[path] for path, same in kept.items()
            if same and not any(path[:m.end()] in moved for m in _ITEM.finditer(path))}


def _same(validated: Any, raw: str) -> bool:
    """Whether the validated value is the one the answer spelled at that place: the same text (up
    to surrounding space), the same boolean or null, or the same number however written
    (``12.50``, ``"12.5"`` as a Decimal)."""
    value = json.loads(raw)
    if value is None or validated is None or isinstance(value, bool) or isinstance(validated, bool):
        return value is validated
    if isinstance(value, str) and isinstance(validated, str):
        return value.strip() == validated.strip()
    try:
        return math.isclose(float(value), float(validated), rel_tol=1e-12, abs_tol=0.0)
    except (TypeError, ValueError, OverflowError):
        return False


def pieces_from_bytes(tokens: Iterable[tuple[bytes, float]]) -> tuple[tuple[str, float], ...]:
    """``(piece, logprob)`` from tokens given as bytes: one incremental UTF-8 decoder over them, so
    a character split across tokens lands on the token that completes it, carrying the
    log-probabilities of the tokens that began it (a value's confidence counts every token of it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
    out, pending = [], 0.0
    for raw, logprob in tokens:
        piece = decoder.decode(raw)
        if not piece:
            pending += logprob
            continue
        out.append((piece, logprob + pending))
        pending = 0.0
    if pending:
        out.append(("", pending))
    return tuple(out)


def calibration(pairs: Iterable[tuple[float, bool]], bins: int = 10) -> dict[str, Any]:
    """Expected calibration error of (confidence, correct) pairs over ``bins`` equal-width bins,
    and each bin's count, mean confidence and accuracy (a reliability diagram's bars)."""
    pairs = [(min(1.0, max(0.0, float(p))), bool(ok)) for p, ok in pairs if p is not None and math.isfinite(p)]
    rows = []
    ece = 0.0
    for number in range(bins):
        low, high = number / bins, (number + 1) / bins
        inside = [(p, ok) for p, ok in pairs if low <= p < high or (number == bins - 1 and p == 1.0)]
        if not inside:
            rows.append({"low": low, "high": high, "count": 0, "confidence": None, "accuracy": None})
            continue
        mean = sum(p for p, _ in inside) / len(inside)
        accuracy = sum(ok for _, ok in inside) / len(inside)
        ece += len(inside) / len(pairs) * abs(accuracy - mean)
        rows.append({"low": low, "high": high, "count": len(inside), "confidence": round(mean, 4),
                     "accuracy": round(accuracy, 4)})
    return {"ece": round(ece, 4) if pairs else None, "pairs": len(pairs), "bins": rows}
