"""The Store contract and the plain records that cross it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from schemas import CallRecord, DeadLetter, Document, StageResult

DocRef = tuple[str, str]  # (tenant, doc_key)
#: (stream, partition, offset). Versions of one document are ordered by it: within a partition or a
#: file a later offset is newer; across partitions the tuple order decides (stable, if arbitrary).
Version = tuple[str, int, int]
#: (stage, table, schema) of each Extract stage: where its typed rows go.
TypedTable = tuple[str, str, type[BaseModel]]


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
    #: Per value path, ``[probability, "logprob" | "agreement"]`` (``etl.confidence``), where known.
    confidence: dict[str, list[Any]] | None = None


@dataclass(frozen=True)
class DocumentOutcome:
    """Everything one version of a document produced: its results, the dead letter it ended as, or
    both (the stages before the one that failed).

    The store keeps it only if it is the document's newest version (its position is not older than
    the stored one); an older version's results are dropped, while its attempts and cache entries
    (paid work) are always kept.
    """

    document: Document | None
    #: New or changed results; stages already stored for this exact key are not repeated.
    results: tuple[StageResult, ...] = ()
    #: Every stage this version has a result for once written (stored before, or in ``results``):
    #: the document's results of any other stage, and their typed rows, are removed with it.
    stages: tuple[str, ...] = ()
    typed_rows: tuple[tuple[str, dict[str, Any]], ...] = ()  # (table, fields) per Extract result
    calls: tuple[CallRecord, ...] = ()
    cache: tuple[CacheEntry, ...] = ()
    dead_letter: DeadLetter | None = None
    #: The version still ends at the open dead letter stored at its own position (a later stage's
    #: known failure, not asked again): the store leaves that letter open instead of resolving it.
    letter_stands: bool = False
    #: The document may have open dead letters, so this outcome is written even with nothing new
    #: (the store settles letters for every outcome it writes, from the letters as stored).
    settles_dead_letters: bool = False
    #: Sampled for human review: (stage, output, why sampled, the text kept for reviewers or "").
    reviews: tuple[tuple[str, dict[str, Any], str, str], ...] = ()
    #: (cache key, text) of each fresh answer of a routed stage: its student's training set grows.
    texts: tuple[tuple[str, str], ...] = ()
    #: Shadow checks: (student id, stage, cache key, student's label, the LLM's label).
    checks: tuple[tuple[int, str, str, str, str], ...] = ()
    #: ``stage_chunks`` rows (``stage`` and the columns) of stages answered in chunks, and
    #: ``field_spans`` rows of Extract results: written with, and replaced like, the results.
    chunks: tuple[dict[str, Any], ...] = ()
    spans: tuple[dict[str, Any], ...] = ()
    #: Keys this document claimed whose answer is cached under another key (a budget's fallback
    #: model's): their claims go when this commits, as a cached key's do.
    claimed: tuple[str, ...] = ()
    #: The message's original bytes: what a ``store_rejected`` dead letter keeps if the store
    #: refuses this outcome.
    payload: bytes = b""


@dataclass
class Batch:
    """One store transaction: outcomes plus the positions they complete."""

    outcomes: list[DocumentOutcome] = field(default_factory=list)
    #: (stream, partition) → next offset; every message before it has an outcome in the store.
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    #: The source has a dead-letter channel: this batch's new letters are written unpublished and
    #: go out through ``SqlStore.publish_pending`` after the commit.
    outbox: bool = False


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
    #: (tenant, doc_key) → position of the stored version: a message older than it is a no-op.
    versions: dict[DocRef, Version] = field(default_factory=dict)
    #: cache key → reason of the open dead letters in ``dead``.
    dead_reasons: dict[str, str] = field(default_factory=dict)

    #: Cache keys the document already holds at an older position (the same content again): a
    #: newer version served them from the cache without a call record (nothing was paid or saved).
    restated: frozenset[str] = frozenset()
    #: Stored results that have no cache entry (a router's student answered them), by cache key,
    #: as entries: a newer copy of the same content keeps them instead of asking again.
    held: dict[str, CacheEntry] = field(default_factory=dict)

    def for_newer_version(self, ref: DocRef, stages: Iterable[str]) -> Lookup:
        """What a message newer than its document's stored version runs with. The stored results
        and letters are another version's, even for the same content (a producer's retry, an
        A-B-A edit): they sit at an older position, which this version replaces. So it is computed
        from the cache alone (no call for what is cached), and settles the older letters: a key
        that failed at an older position fails here again, with its reason, without a call."""
        held = {found[0] for stage in stages if (found := self.results.get((*ref, stage))) is not None}
        dead = self.dead.get(ref, set())
        return Lookup(results={}, dead={ref: dead}, cache=self.cache, restated=frozenset(held | dead),
                      dead_reasons={key: self.dead_reasons[key] for key in dead if key in self.dead_reasons},
                      held=self.held)


class Store(ABC):
    """Where results, cache, calls and positions live. Every write is one transaction."""

    @abstractmethod
    def prepare(self, typed_tables: Sequence[TypedTable]) -> None:
        """Called once before a run: migrates the schema and creates the typed extraction tables.
        Raises if a typed table exists with columns that no longer match its schema."""

    @abstractmethod
    def lookup(self, pipeline: str, docs: Iterable[DocRef], cache_keys: Iterable[str],
               positions: Iterable[tuple[str, int, int]] = (), *, outputs: bool = True) -> Lookup:
        """Called for each polled batch, before any LLM call: stored results (a redelivery is a
        no-op), open dead letters by document and by position, and cached outputs. Read-only.
        With ``outputs=False`` stored results come without their output (None): enough to know
        they are stored, and much cheaper when no ``when=`` predicate needs to read them."""

    def unsettled(self, pipeline: str, expected: Sequence[tuple[str, str, str, str]],
                  at: Mapping[DocRef, Version]) -> set[DocRef]:
        """Of the documents in ``expected`` ((tenant, doc key, stage, cache key) for every stage of
        each), those not settled: some stage has no stored result for exactly that key, the
        document has an open dead letter, or its stored version is not at ``at[ref]`` (the
        message's position: a newer copy of the same content is a new version). The rest are
        redeliveries with nothing to do, found without reading their rows (a replay's look-up).
        Read-only."""
        refs = {(tenant, key) for tenant, key, _, _ in expected}
        found = self.lookup(pipeline, refs, [], outputs=False)
        return {(tenant, key) for tenant, key, stage, cache_key in expected
                if found.results.get((tenant, key, stage), ("",))[0] != cache_key} | (refs & found.dead.keys()) | {
            ref for ref in refs if found.versions.get(ref) != at.get(ref)}

    @abstractmethod
    def write(self, pipeline: str, batch: Batch) -> None:
        """Commits a batch: documents, results, typed rows, cache, calls, dead letters and positions.
        Called before the source commits; positions are written last, with or after everything
        they complete. If it raises, no position moved and the messages will be redelivered.
        Idempotent: writing the same batch twice adds no row. An outcome the store refuses (a
        value it cannot hold) becomes that document's ``store_rejected`` dead letter; it never
        fails the batch."""

    @abstractmethod
    def stored_position(self, pipeline: str, stream: str, partition: int) -> int | None:
        """The next offset to read for a partition, or None if it was never processed."""

    def publish_pending(self, pipeline: str, publish: Callable[[list[DeadLetter]], None]) -> int:  # noqa: B027
        """Hands the pipeline's dead letters not yet published to ``publish`` (the source's
        channel) and marks them published once it returns; returns how many. Called after each
        commit that wrote letters, and once at start-up (for letters a crash left unpublished).
        If ``publish`` raises, they stay pending and the error propagates."""
        return 0
