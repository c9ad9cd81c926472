"""A stage with the hashes that identify its outputs: what a run, an eval and ``etl distill``
key answers by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dedup import cache_key, canonical_json, sha256_hex, stage_fingerprint
from etl.llm.base import LLM
from etl.stages.base import Stage


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

    @classmethod
    def of(cls, stage: Stage, llm: LLM, repairs: int = 1) -> StagePlan:
        """``repairs``: re-asks after an invalid answer, which decide what ends up valid."""
        spec = {**stage.spec(), "model": llm.model_id, "params": llm.params, "repairs": repairs}
        return cls(
            stage=stage,
            llm=llm,
            fingerprint=stage_fingerprint(spec),
            prompt_hash=sha256_hex(canonical_json([spec["system"], spec["user"]])),
            schema_hash=sha256_hex(canonical_json(spec["schema"])),
        )

    def key(self, document: Keyed) -> str:
        return cache_key(document.tenant, self.fingerprint, document.content_hash)
