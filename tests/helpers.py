"""Small helpers for tests: row counts and table snapshots."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, inspect, text

CORE_TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "source_positions", "dead_letters")


def counts(url: str, tables: tuple[str, ...] = CORE_TABLES) -> dict[str, int]:
    engine = create_engine(url)
    try:
        names = set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in tables if t in names}
    finally:
        engine.dispose()


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()
