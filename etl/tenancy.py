"""Per-tenant policy: review sampling, daily token budgets. Pure decisions; the runner does the I/O."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timezone

from dedup import canonical_json, sha256_hex


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


class TenantBudgets:
    """Daily token budgets per tenant (UTC days). ``spent_today`` reads what the store already
    recorded, once per tenant and day; this process's own calls are added as they happen. Several
    workers may overshoot a budget by what they have in flight, never by more."""

    def __init__(self, limits: Mapping[str, int], spent_today: Callable[[str, date], Awaitable[int]]) -> None:
        self.limits = dict(limits)
        self._spent_today = spent_today
        self._spent: dict[tuple[str, date], int] = {}
        self._lock = asyncio.Lock()

    async def allows(self, tenant: str) -> bool:
        limit = self.limits.get(tenant)
        if limit is None:
            return True
        day = datetime.now(timezone.utc).date()
        async with self._lock:
            if (tenant, day) not in self._spent:
                self._spent[(tenant, day)] = await self._spent_today(tenant, day)
        return self._spent[(tenant, day)] < limit

    def spend(self, tenant: str, tokens: int) -> None:
        if tenant in self.limits:
            key = (tenant, datetime.now(timezone.utc).date())
            self._spent[key] = self._spent.get(key, 0) + tokens
