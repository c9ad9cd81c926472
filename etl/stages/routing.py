"""The router's declaration on a Classify stage: ``Classify(..., router=Router())``.

Plain settings the runtime reads; training a student and serving it live below the runtime, in
``etl.quality.router``. Not in the stage's fingerprint: it decides who answers, never what the
model is asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from etl.errors import ConfigError


@dataclass(frozen=True)
class Router:
    """Routing for one Classify stage: ``Classify(..., router=Router())``. Off unless given.

    Args:
        shadow_rate: Share of the student's documents also asked of the LLM (the shadow checks).
        window: Shadow checks judged together (the most recent).
        min_checks: Checks needed before any verdict.
        alpha: A student is switched off when agreement this low over the last ``min_checks`` or
            the last ``window`` checks has probability below ``alpha``/2 if it still agreed as certified.
        refresh_s: How often a running worker looks for students distilled or switched off elsewhere.
    """

    shadow_rate: float = 0.02
    window: int = 200
    min_checks: int = 30
    alpha: float = 0.001
    refresh_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.shadow_rate <= 1.0:
            raise ConfigError(f"Router(shadow_rate={self.shadow_rate}): give a share between 0 and 1")
        if not 0 < self.min_checks <= self.window:
            raise ConfigError(f"Router(min_checks={self.min_checks}, window={self.window}): need 0 < min_checks <= window")
        if not 0.0 < self.alpha < 0.5:
            raise ConfigError(f"Router(alpha={self.alpha}): give a significance level between 0 and 0.5")

    def shadowed(self, key: str) -> bool:
        """Whether the document with this cache key is a shadow check (the same after a restart)."""
        return int(key[:8], 16) < self.shadow_rate * 16**8
