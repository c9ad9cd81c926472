"""A stage with the hashes that identify its outputs: what a run, an eval and ``etl distill``
key answers by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dedup import cache_key, canonical_json, content_hash, sha256_hex, stage_fingerprint
from etl.llm.base import LLM
from etl.stages.base import Stage
from etl.stages.chunking import Chunk, chunk, estimate_tokens

#: The context assumed for a model that does not say its own (``LLM.context_tokens``).
DEFAULT_CONTEXT = 4096


class Keyed(Protocol):
    """A document, decoded or whole: what its cache keys are made of."""

    tenant: str
    content_hash: str


@dataclass(frozen=True)
class StagePlan:
    """A stage with the hashes that identify its outputs, computed once per run."""

    stage: Stage
    fingerprint: str
    prompt_hash: str
    schema_hash: str
    llm: LLM
    #: What keys one chunk's answer (``fingerprint`` unless the stage reads documents in chunks).
    chunk_fingerprint: str = ""
    #: Most tokens of document text per chunk; None: the stage reads every document whole.
    chunk_tokens: int | None = None
    #: Tokens in a text: the model's own tokenizer where it has one (``LLM.token_counter``), else
    #: an estimate of 4 characters a token.
    count: Callable[[str], int] = estimate_tokens
    #: The same stage with the cheaper model of the tenant's budget (``Budget.fallback``), which
    #: answers over its soft limit; its own fingerprint keys its answers.
    fallback: StagePlan | None = None

    @classmethod
    def of(cls, stage: Stage, llm: LLM, repairs: int = 1) -> StagePlan:
        """``repairs``: re-asks after an invalid answer, which decide what ends up valid."""
        model = {"model": llm.model_id, "params": llm.params, "repairs": repairs}
        spec = {**stage.spec(), **model}
        fingerprint = stage_fingerprint(spec)
        chunking = getattr(stage, "chunking", None)
        chunk_tokens, count = None, estimate_tokens
        if chunking is not None:
            count = llm.token_counter() or estimate_tokens
            # the model's context less the fixed prompt (instructions and the user template around the
            # text), the answer's budget, each re-ask's room (the answer it repeats and the complaint)
            # and a margin for the chat template's own tokens
            prompt = count(spec["system"]) + count(spec["user"])
            chunk_tokens = chunking.max_tokens or max(
                256, (llm.context_tokens or DEFAULT_CONTEXT) - prompt - stage.max_tokens * (1 + repairs)
                - 128 * repairs - 64)
        return cls(
            stage=stage,
            llm=llm,
            fingerprint=fingerprint,
            prompt_hash=sha256_hex(canonical_json([spec["system"], spec["user"]])),
            schema_hash=sha256_hex(canonical_json(spec["schema"])),
            chunk_fingerprint=stage_fingerprint({**stage.chunk_spec(), **model}) if chunking else fingerprint,
            chunk_tokens=chunk_tokens,
            count=count,
        )

    def chunks(self, content: str) -> list[Chunk]:
        """A document's chunks when the stage reads long documents in chunks (one when it fits),
        else none: the stage reads it whole."""
        chunking = getattr(self.stage, "chunking", None)
        if self.chunk_tokens is None or chunking is None:
            return []
        return chunk(content, self.chunk_tokens, chunking.overlap_tokens, self.count)

    def key(self, document: Keyed) -> str:
        return cache_key(document.tenant, self.fingerprint, document.content_hash)

    def chunk_key(self, tenant: str, text: str) -> str:
        """One chunk's cache key: its own text (never its position), so an unchanged chunk of an
        edited document keeps its key wherever it moved."""
        return cache_key(tenant, self.chunk_fingerprint, content_hash(text))
