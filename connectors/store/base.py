"""The Store contract and the plain records that cross it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from schemas import CallRecord, DeadLetter, Document, StageResult

DocRef = tuple[str, str]  # (tenant, doc_key)


@dataclass(frozen=True)
class CacheEntry:
    """A validated output, reusable by any document of the same tenant with the same content."""

    cache_key: str
    tenant: str
    stage: str
    fingerprint: str
    output: dict[str, Any]
    model: str
    tokens_in: int
    tokens_out: int
    cost: float
    structured: str | None = None
    system_fingerprint: str | None = None


@dataclass(frozen=True)
class DocumentOutcome:
    """Everything one document produced: its results, or the dead letter it ended as."""

    document: Document | None
    results: tuple[StageResult, ...] = ()
    typed_rows: tuple[tuple[str, dict[str, Any]], ...] = ()  # (table, fields) per Extract result
    calls: tuple[CallRecord, ...] = ()
    cache: tuple[CacheEntry, ...] = ()
    dead_letter: DeadLetter | None = None
    #: The document had an open dead letter and now has its results: it leaves quarantine.
    resolves_dead_letter: bool = False
    #: (stage, output, why) sampled for human review.
    reviews: tuple[tuple[str, dict[str, Any], str], ...] = ()


@dataclass
class Batch:
    """One store transaction: outcomes plus the positions they complete."""

    outcomes: list[DocumentOutcome] = field(default_factory=list)
    #: (stream, partition) → next offset; every message before it has an outcome in the store.
    positions: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass
class Lookup:
    """What the store already knows about a set of documents and cache keys."""

    #: (tenant, doc_key, stage) → (cache_key, output) of the stored result (output None when not asked for).
    results: dict[tuple[str, str, str], tuple[str, dict[str, Any] | None]]
    #: (tenant, doc_key) → cache keys of open dead letters (terminal failures already recorded).
    dead: dict[DocRef, set[str]]
    cache: dict[str, CacheEntry]
    #: (stream, partition, offset) of the asked-about positions that already have a dead letter.
    dead_positions: set[tuple[str, int, int]] = field(default_factory=set)


class Store(ABC):
    """Where results, cache, calls and positions live. Every write is one transaction."""

    @abstractmethod
    def prepare(self, typed_tables: Sequence[tuple[str, type[BaseModel]]]) -> None:
        """Called once before a run: migrates the schema and creates the typed extraction tables.
        Raises if a typed table exists with columns that no longer match its schema."""

    @abstractmethod
    def lookup(self, pipeline: str, docs: Iterable[DocRef], cache_keys: Iterable[str],
               positions: Iterable[tuple[str, int, int]] = (), *, outputs: bool = True) -> Lookup:
        """Called for each polled batch, before any LLM call: stored results (a redelivery is a
        no-op), open dead letters by document and by position, and cached outputs. Read-only.
        With ``outputs=False`` stored results come without their output (None): enough to know
        they are stored, and much cheaper when no ``when=`` predicate needs to read them."""

    def unsettled(self, pipeline: str, expected: Sequence[tuple[str, str, str, str]]) -> set[DocRef]:
        """Of the documents in ``expected`` ((tenant, doc key, stage, cache key) for every stage of
        each), those not settled: some stage has no stored result for exactly that key, or the
        document has an open dead letter. The rest are redeliveries with nothing to do, found
        without reading their rows (a replay's look-up). Read-only."""
        refs = {(tenant, key) for tenant, key, _, _ in expected}
        found = self.lookup(pipeline, refs, [], outputs=False)
        return {(tenant, key) for tenant, key, stage, cache_key in expected
                if found.results.get((tenant, key, stage), ("",))[0] != cache_key} | (refs & found.dead.keys())

    @abstractmethod
    def write(self, pipeline: str, batch: Batch) -> None:
        """Commits a batch atomically: documents, results, typed rows, cache, calls, dead letters
        and positions. Called before the source commits; if it raises, nothing was written and the
        messages will be redelivered. Idempotent: writing the same batch twice adds no row."""

    @abstractmethod
    def stored_position(self, pipeline: str, stream: str, partition: int) -> int | None:
        """The next offset to read for a partition, or None if it was never processed."""
