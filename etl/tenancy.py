"""Per-tenant policy: review sampling, daily token budgets. Pure decisions; the runner does the I/O."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import TYPE_CHECKING

from dedup import canonical_json, sha256_hex
from etl.errors import ConfigError

if TYPE_CHECKING:
    from etl.llm.base import LLM


@dataclass(frozen=True)
class ReviewSampling:
    """Which results go to the human review queue, per tenant and stage.

    Args:
        rate: Uniform share of results sampled (decided by a hash of the document, so a redelivery
            never samples differently).
        below_confidence: Results whose confidence is below this are always sampled.
        first_labels: The first result with each label a tenant gets is sampled.
        store_text: Keep the document's text with each sampled item (``review_queue.content``)
            for reviewers and, promoted, the golden set; False keeps only key and output, for
            pipelines whose text must not be copied out of the tenants' own systems.
    """

    rate: float = 0.01
    below_confidence: float | None = 0.5
    first_labels: bool = True
    store_text: bool = True

    def reason(self, tenant: str, stage: str, doc_key: str, output: Mapping[str, object],
               seen_labels: set[tuple[str, str, str]]) -> str | None:
        label = output.get("label")
        if self.first_labels and isinstance(label, str) and (tenant, stage, label) not in seen_labels:
            seen_labels.add((tenant, stage, label))
            return "first_label"
        confidence = output.get("confidence")
        if self.below_confidence is not None and isinstance(confidence, float) and confidence < self.below_confidence:
            return "low_confidence"
        draw = int(sha256_hex(canonical_json([tenant, stage, doc_key]))[:8], 16) / 0xFFFFFFFF
        return "uniform" if draw < self.rate else None


@dataclass(frozen=True)
class Budget:
    """A tenant's daily token budget (UTC days): ``Pipeline(budgets={"acme": Budget(...)})``; a
    plain number is ``Budget(tokens=number)``.

    Args:
        tokens: The hard limit: once the tenant's calls today spent this many tokens, its documents
            are quarantined (``budget_exceeded``; ``etl dlq replay`` them the next day).
        fallback: A cheaper model for every stage, or ``{stage name: model}``: once the tenant spent
            ``soft`` tokens today, those stages ask it instead. It has its own stage fingerprint, so
            its answers are cached and stored apart from the main model's (provenance says which
            model answered). An answer either model already gave for the same content is used
            rather than paid again, whichever side of the limit the tenant is on.
        soft: Tokens a day after which the fallback answers; default 80% of ``tokens``.
    """

    tokens: int
    fallback: LLM | Mapping[str, LLM] | None = None
    soft: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ConfigError(f"Budget(tokens={self.tokens!r}): give a whole number of tokens a day, 0 or more")
        from etl.llm.base import LLM  # noqa: PLC0415 - a type check, not a dependency of this module

        models = list(self.fallback.values()) if isinstance(self.fallback, Mapping) else [self.fallback]
        if isinstance(self.fallback, Mapping) and not self.fallback or not all(
                m is None and self.fallback is None or isinstance(m, LLM) for m in models):
            raise ConfigError(f"Budget(fallback={self.fallback!r}): give a model (an etl LLM) or "
                              "{stage name: model} with at least one stage")
        if self.soft is not None:
            if self.fallback is None:
                raise ConfigError(f"Budget(soft={self.soft!r}) names no fallback model to switch to; add fallback= "
                                  "or leave soft out")
            if isinstance(self.soft, bool) or not isinstance(self.soft, int) or not 0 <= self.soft <= self.tokens:
                raise ConfigError(f"Budget(soft={self.soft!r}, tokens={self.tokens}): give a whole number of tokens "
                                  "between 0 and tokens")

    @property
    def soft_limit(self) -> int | None:
        """Tokens after which the fallback answers (None: no fallback)."""
        if self.fallback is None:
            return None
        return self.soft if self.soft is not None else int(self.tokens * 0.8)

    def fallback_for(self, stage: str) -> LLM | None:
        """The model that answers ``stage`` over the soft limit, if any."""
        if self.fallback is None or not isinstance(self.fallback, Mapping):
            return self.fallback
        return self.fallback.get(stage)


class TenantBudgets:
    """Daily token budgets per tenant (UTC days). ``spent_today`` reads what the store already
    recorded, once per tenant and day; this process's own calls are added as they happen. Several
    workers may overshoot a budget by what they have in flight, never by more."""

    def __init__(self, limits: Mapping[str, Budget], spent_today: Callable[[str, date], Awaitable[int]]) -> None:
        self.limits = dict(limits)
        self._spent_today = spent_today
        self._spent: dict[tuple[str, date], int] = {}
        self._lock = asyncio.Lock()

    async def allows(self, tenant: str) -> bool:
        """Whether the tenant is under its hard limit today."""
        budget = self.limits.get(tenant)
        return budget is None or await self._spent_now(tenant) < budget.tokens

    async def over_soft(self, tenant: str) -> bool:
        """Whether the tenant's stages with a fallback model should ask it now."""
        budget = self.limits.get(tenant)
        soft = None if budget is None else budget.soft_limit
        return soft is not None and await self._spent_now(tenant) >= soft

    async def _spent_now(self, tenant: str) -> int:
        day = datetime.now(timezone.utc).date()
        async with self._lock:
            if (tenant, day) not in self._spent:
                self._spent[(tenant, day)] = await self._spent_today(tenant, day)
        return self._spent[(tenant, day)]

    def spend(self, tenant: str, tokens: int) -> None:
        if tenant in self.limits:
            key = (tenant, datetime.now(timezone.utc).date())
            self._spent[key] = self._spent.get(key, 0) + tokens
