"""structlog setup. Events carry bound context (tenant, stage, doc key, partition, offset),
never document content or secrets."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", json: bool = False) -> None:
    """Routes structlog events to stderr, as JSON lines in production or readable lines on a console."""
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # sys.stderr is looked up per logger, not captured now: it may be swapped (tests, CLI runners).
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
