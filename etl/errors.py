"""One exception tree for idem-etl. Every class says whether retrying can help.

```
EtlError                       retryable=False  the root; catch this to catch ours
├── ConfigError                                 a pipeline or setting a user must fix
├── SourceError                                 input cannot be read at all (missing file, broker gone)
├── BadInput                   reason=bad_input one message cannot be decoded → dead letter
├── StageError               reason=stage_error  user code of a stage (when=, a validator) raised
├── StoreError                                  the database refused or is unreachable
└── LLMError                 reason=provider_error   a model call failed (4xx other than below)
    ├── BudgetExceeded         reason=budget_exceeded  a tenant's token budget is spent
    ├── TransientLLMError      retryable=True   5xx, connection resets (reason=provider_error)
    │   ├── RateLimited                         429; ``retry_after`` seconds when the provider says
    │   └── LLMTimeout         reason=timeout   no answer in time
    └── OutputError            retryable=False  the model answered, but not with a valid result
        ├── Truncated          reason=truncated
        ├── Refusal            reason=refusal
        ├── SchemaInvalid      reason=schema_invalid
        ├── SemanticInvalid    reason=semantic_invalid
        └── ContextOverflow    reason=context_overflow
```

Retries (tenacity) key on ``retryable`` only. Third-party errors are translated at the boundary where
they happen and chained with ``raise ... from exc`` so the cause is never lost. ``reason`` is the typed
reason a dead letter records.
"""

from __future__ import annotations


class EtlError(Exception):
    """Root of every error idem-etl raises on purpose."""

    retryable: bool = False
    reason: str = "error"


class ConfigError(EtlError):
    """A pipeline, stage or setting is wrong; the message says what to change."""

    reason = "config"


class SourceError(EtlError):
    """The source as a whole cannot be read (a missing file, an unreachable broker)."""

    reason = "source"


class BadInput(EtlError):
    """One message cannot become a Document (bad UTF-8, bad JSON, no content, no tenant, too large)."""

    reason = "bad_input"


class StageError(EtlError):
    """User code inside a stage (a ``when=`` predicate, a validator) raised: that document's dead
    letter, never the run's end."""

    reason = "stage_error"


class StoreError(EtlError):
    """The store could not be reached or refused a write."""

    reason = "store"


class LLMError(EtlError):
    """A model call failed."""

    reason = "provider_error"
    #: Earlier sends of this request the provider received and never answered (a batch's errored
    #: or expired lines, sent again by the backend itself): attempts too, recorded at no cost.
    unanswered: int = 0


class TransientLLMError(LLMError):
    """Worth retrying: rate limits, server errors, timeouts, dropped connections."""

    retryable = True

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(TransientLLMError):
    """HTTP 429. ``retry_after`` is the provider's ``Retry-After``, which the retry loop honours."""


class LLMTimeout(TransientLLMError):
    """The provider did not answer in time."""

    reason = "timeout"


class PeerFailed(LLMError):
    """Another worker's call for the same key (same tenant, stage and content) just ended as a dead
    letter: this document ends the same way without paying for it again (not cached: a later run
    may retry it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"another worker's call for the same content failed ({reason}); "
                         "`etl dlq replay` retries it")
        self.reason = reason


class BudgetExceeded(LLMError):
    """The tenant's token budget for the day is spent; the document waits in quarantine."""

    reason = "budget_exceeded"


class OutputError(LLMError):
    """The model answered, but the answer is not a valid result. ``raw`` keeps what it said."""

    def __init__(self, message: str, raw: str | None = None) -> None:
        super().__init__(message)
        self.raw = raw


class Truncated(OutputError):
    """The answer hit the token limit (``finish_reason == "length"``): not a parse error."""

    reason = "truncated"


class Refusal(OutputError):
    """The model declined to answer."""

    reason = "refusal"


class SchemaInvalid(OutputError):
    """The answer is not JSON, or does not match the stage's schema."""

    reason = "schema_invalid"


class SemanticInvalid(OutputError):
    """The answer matches the schema but fails a semantic check (a date that does not parse...)."""

    reason = "semantic_invalid"


class ContextOverflow(OutputError):
    """The prompt does not fit the model's context window; retrying the same prompt cannot help."""

    reason = "context_overflow"
