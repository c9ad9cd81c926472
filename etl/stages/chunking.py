"""Long documents in chunks whose boundaries come from the content, so an edit moves only the
boundaries near it and every other chunk keeps its cache key.

A document is cut into *units* at its natural boundaries (pages, then blank lines, then lines,
then spaces when a single line is too long), and units are grouped into chunks of at most
``max_tokens``. Whether a chunk ends after a unit depends only on that unit's own text and on the
size of the chunk so far: a chunk ends after a unit whose hash falls under a threshold proportional
to the unit's size (content-defined chunking; in a paged text only units that end a page qualify),
once the chunk holds ``max_tokens/4``;
it must end where the next unit would not fit. After an edit, the first such boundary after it at
which both versions agree on the size since the last cut puts every later boundary back where it
was: the chunks before the edit and after that boundary are the same text, hence the same keys.

Tokens are counted by the stage's model's own tokenizer where the backend has one
(``LLM.token_counter``: ``LocalLLM``), else estimated at 4 characters each (the usual average of
English BPE vocabularies; receipts' capitals and digits run nearer 2).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from dedup import sha256_hex
from etl.errors import ConfigError

#: Characters per token where the model gives no tokenizer.
CHARS_PER_TOKEN = 4
_PARAGRAPH = re.compile(r"\f|\n[ \t]*\n+")
_LINE = re.compile(r"\n")


def estimate_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Chunk:
    """``text`` = the document's ``content[start:end]``."""

    ordinal: int
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Chunking:
    """How an ``Extract`` stage reads a document longer than its model's context.

    Args:
        max_tokens: Most tokens of document text per chunk (the prompt and the answer come on top).
            None: the model's context (``LLM.context_tokens``, else 4,096) less the stage's prompt
            and answer budget.
        overlap_tokens: Text of the previous chunk repeated at the start of the next (whole lines),
            so a value cut by a boundary is whole in one of them; an edit there also re-asks that
            neighbour. 0 by default: chunks end at natural boundaries, where overlap only repeats
            values for the merge to drop.
    """

    max_tokens: int | None = None
    overlap_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 64:
            raise ConfigError(f"Chunking(max_tokens={self.max_tokens}): give at least 64 tokens per chunk")
        if self.overlap_tokens < 0 or (self.max_tokens is not None and self.overlap_tokens >= self.max_tokens // 2):
            raise ConfigError(f"Chunking(overlap_tokens={self.overlap_tokens}): give 0 up to half of max_tokens")

    def spec(self) -> dict[str, int | None]:
        return {"max_tokens": self.max_tokens, "overlap_tokens": self.overlap_tokens}


def units(text: str, max_chars: int) -> list[tuple[int, int]]:
    """(start, end) of the natural pieces of ``text``, covering it; none longer than ``max_chars``.
    A piece ends after its separator (the page break or blank line), so pieces concatenate back."""
    found: list[tuple[int, int]] = []
    start = 0
    for match in _PARAGRAPH.finditer(text):
        found.append((start, match.end()))
        start = match.end()
    if start < len(text):
        found.append((start, len(text)))
    out: list[tuple[int, int]] = []
    for begin, end in found:
        if end - begin <= max_chars:
            out.append((begin, end))
            continue
        out.extend(_split(text, begin, end, max_chars))
    return out


def _split(text: str, begin: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """A piece too long for one chunk, at line ends, then at spaces, then anywhere."""
    pieces: list[tuple[int, int]] = []
    while end - begin > max_chars:
        window = text[begin:begin + max_chars]
        cut = max(window.rfind("\n"), window.rfind(" "))
        cut = begin + (cut + 1 if cut > max_chars // 4 else max_chars)
        pieces.append((begin, cut))
        begin = cut
    if begin < end:
        pieces.append((begin, end))
    return pieces


def _fitting(text: str, begin: int, end: int, body: int, count: Callable[[str], int]) -> list[tuple[int, int]]:
    """A piece, cut further (as :func:`_split` cuts) until every part holds at most ``body`` tokens:
    a tokenizer can read fewer characters a token than the estimate that sized the pieces."""
    tokens = count(text[begin:end])
    if tokens <= body or end - begin <= 1:
        return [(begin, end)]
    return [part for a, b in _split(text, begin, end, max(1, (end - begin) * body // tokens))
            for part in _fitting(text, a, b, body, count)]


def _anchor(piece: str, tokens: int, spread: int, paged: bool) -> bool:
    """Whether a chunk may end after this piece: with a probability ∝ its size, decided by its hash
    (the same piece decides the same way in every version); in a paged text, only at a page's end."""
    if paged and not piece.endswith("\f"):
        return False
    return int(sha256_hex(piece)[:8], 16) < min(1.0, tokens / max(spread, 1)) * 0xFFFFFFFF


def chunk(text: str, max_tokens: int, overlap_tokens: int = 0,
          count: Callable[[str], int] = estimate_tokens) -> list[Chunk]:
    """The document's chunks, in order (one chunk when it fits)."""
    if count(text) <= max_tokens:
        return [Chunk(0, 0, len(text), text)]
    body = max_tokens - overlap_tokens
    pieces = [part for begin, end in units(text, body * CHARS_PER_TOKEN) for part in _fitting(text, begin, end, body, count)]
    sizes = [count(text[begin:end]) for begin, end in pieces]
    floor, spread = body // 4, body // 2  # at least a quarter full; ends ~ three quarters full on average
    paged = "\f" in text
    bounds: list[tuple[int, int]] = []
    start, size = pieces[0][0], 0
    for number, (begin, end) in enumerate(pieces):
        size += sizes[number]
        last = number == len(pieces) - 1
        following = 0 if last else sizes[number + 1]
        if last or size + following > body or (size >= floor and _anchor(text[begin:end], sizes[number], spread, paged)):
            bounds.append((start, end))
            start, size = end, 0
    chunks = []
    for ordinal, (begin, end) in enumerate(bounds):
        head = begin
        if overlap_tokens and ordinal:
            head = _overlap_start(text, bounds[ordinal - 1][0], begin, overlap_tokens, count)
        chunks.append(Chunk(ordinal, head, end, text[head:end]))
    return chunks


def _overlap_start(text: str, previous: int, begin: int, overlap_tokens: int, count: Callable[[str], int]) -> int:
    """Where the overlap taken from the previous chunk starts: whole lines, at most
    ``overlap_tokens``, counted back from ``begin``."""
    head = begin
    while head > previous:
        line = text.rfind("\n", previous, head - 1)
        candidate = previous if line == -1 else line + 1
        if count(text[candidate:begin]) > overlap_tokens:
            break
        head = candidate
    return head
