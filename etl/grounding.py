"""Where in the source each extracted value came from: a character span per value, or a flag that
it could not be found (a model that invents a value invents text the document does not have).

Every string and number of an output is looked for in the document's text, in this order:
``exact`` (the value as written), ``normalized`` (case and runs of whitespace ignored), ``number``
(the same number, however written: ``12.50``, ``12.5``, ``1,234.00``) and ``fuzzy`` (the best
window scoring at least ``FUZZY_MIN`` of 100 in rapidfuzz's partial ratio, for OCR noise). A value
found none of these ways is ``none``: ungrounded. Spans are document offsets (``content[start:end]``),
with the 1-based page where the text has page breaks. Pure: text in, spans out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from etl.formats import page_of

#: Least rapidfuzz partial-ratio score (0-100) a fuzzy match needs.
FUZZY_MIN = 90.0
#: Shortest string value matched fuzzily (a two-letter value matches anything at 90).
FUZZY_MIN_CHARS = 5
_NUMBER = re.compile(r"(?<![\d.])[-+]?\d[\d,]*(?:\.\d+)?")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Span:
    """One value's place in the source: ``match`` is exact, normalized, number, fuzzy or none."""

    path: str
    value: str
    start: int | None
    end: int | None
    page: int | None
    match: str
    score: float

    @property
    def grounded(self) -> bool:
        return self.match != "none"


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every string and number in an output (``receipts[2].total``); not booleans,
    not nulls, not empty strings."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for number, item in enumerate(value):
            yield from leaves(item, f"{path}[{number}]")
    elif isinstance(value, str):
        if value.strip():
            yield path, value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


class Grounder:
    """Finds values in one document's text (the text's indexes are built once, on first use)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._folded: tuple[str, list[int]] | None = None
        self._numbers: dict[float, tuple[int, int]] | None = None
        self._paged = "\f" in text

    def spans(self, output: dict[str, Any], skip: frozenset[str] = frozenset()) -> list[Span]:
        """A span for every leaf of ``output`` except the fields named in ``skip``."""
        return [self.find(path, value) for path, value in leaves(output) if path.split("[")[0].split(".")[0] not in skip]

    def find(self, path: str, value: Any) -> Span:
        if isinstance(value, str):
            found = self._string(value)
        else:
            found = self._number(float(value))
            if found is None:  # an integer code or id written as text: as a string too
                found = self._string(str(value))
        shown = str(value)[:500]
        if found is None:
            return Span(path, shown, None, None, None, "none", 0.0)
        start, end, match, score = found
        return Span(path, shown, start, end, page_of(self.text, start) if self._paged else 1, match, score)

    def _string(self, value: str) -> tuple[int, int, str, float] | None:
        start = self.text.find(value)
        if start != -1:
            return start, start + len(value), "exact", 100.0
        folded, offsets = self._fold()
        needle = _SPACE.sub(" ", value.strip()).casefold()
        at = folded.find(needle)
        if needle and at != -1:
            return offsets[at], offsets[at + len(needle) - 1] + 1, "normalized", 100.0
        if len(needle) >= FUZZY_MIN_CHARS:
            from rapidfuzz import fuzz  # noqa: PLC0415 - only where exact matches fail

            best = fuzz.partial_ratio_alignment(needle, folded, score_cutoff=FUZZY_MIN)
            if best is not None and best.dest_end > best.dest_start:
                return offsets[best.dest_start], offsets[best.dest_end - 1] + 1, "fuzzy", round(best.score, 1)
        parsed = _as_number(value)
        if parsed is not None:
            found = self._number(parsed)
            if found is not None:
                return found
        return None

    def _number(self, value: float) -> tuple[int, int, str, float] | None:
        if self._numbers is None:
            self._numbers = {}
            for match in _NUMBER.finditer(self.text):
                number = _as_number(match.group())
                if number is not None:
                    self._numbers.setdefault(number, (match.start(), match.end()))
        found = self._numbers.get(value)
        return None if found is None else (*found, "number", 100.0)

    def _fold(self) -> tuple[str, list[int]]:
        """The text casefolded with whitespace runs as one space, and each folded character's
        offset in the original text."""
        if self._folded is None:
            chars: list[str] = []
            offsets: list[int] = []
            last_space = False
            for index, char in enumerate(self.text):
                if char.isspace():
                    if not last_space:
                        chars.append(" ")
                        offsets.append(index)
                    last_space = True
                    continue
                last_space = False
                for folded in char.casefold():
                    chars.append(folded)
                    offsets.append(index)
            self._folded = ("".join(chars), offsets)
        return self._folded


def _as_number(text: str) -> float | None:
    cleaned = text.replace(",", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None
