"""What a stage produces, and the records that make every row explain itself (invariant 6)."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.document import Position

#: ok: a valid answer. retry: a transient failure, retried. repair: an invalid answer, re-asked with
#: its error. failed: the attempt that ended the stage. cache_hit: no call; tokens and cost it saved.
CallOutcome = Literal["ok", "cache_hit", "retry", "repair", "failed"]


class Provenance(BaseModel):
    """Everything needed to tell how a result was made and what it cost."""

    model_config = ConfigDict(frozen=True)

    fingerprint: str
    cache_key: str
    model: str
    prompt_hash: str
    schema_hash: str
    cache_hit: bool
    attempts: int
    tokens_in: int
    tokens_out: int
    cost: float
    latency_ms: float
    #: How the schema was enforced: "outlines", "json_schema", "json_object", "none", or None (fake).
    structured: str | None = None
    system_fingerprint: str | None = None
    #: None: the model answered (or its cache); ``student:<id>``: a router's student did (cost 0).
    answered_by: str | None = None


class StageResult(BaseModel):
    """One validated output of one stage for one document."""

    model_config = ConfigDict(frozen=True)

    stage: str
    output: dict[str, Any]
    provenance: Provenance


class CallRecord(BaseModel):
    """One LLM attempt (or a cache hit and what it saved), as written to ``llm_calls``."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    stage: str
    doc_key: str
    cache_key: str
    model: str
    outcome: CallOutcome
    tokens_in: int
    tokens_out: int
    cost: float
    latency_ms: float
    error: str | None = None
    #: This attempt's own id, made once: writing the record twice (a retried commit) adds one row.
    call_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


class DeadLetter(BaseModel):
    """A message that ended without results: its original bytes and a typed reason."""

    model_config = ConfigDict(frozen=True)

    position: Position
    reason: str
    detail: str
    payload: bytes
    tenant: str | None = None
    doc_key: str | None = None
    stage: str | None = None
    cache_key: str | None = None
    raw_output: str | None = None
