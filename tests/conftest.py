"""Shared fixtures. Services are real: PostgreSQL from services/services.sh (or testcontainers where
Docker works). A test that needs a missing service fails loudly; nothing is skipped in CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "data"


def _docker_works() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A PostgreSQL URL: ETL_TEST_POSTGRES_URL (set by services/services.sh), else testcontainers."""
    url = os.environ.get("ETL_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    if _docker_works():
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

        with PostgresContainer("postgres:16", driver="psycopg") as pg:
            yield pg.get_connection_url()
        return
    pytest.fail("no PostgreSQL: run `services/services.sh start` and `eval \"$(services/services.sh env)\"`, "
                "or use scripts/test.sh which does both")


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty schema on the real server for one test, dropped afterwards."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_server)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in postgres_server else "?"
    yield f"{postgres_server}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'etl.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Each store test runs on the embedded default and on real PostgreSQL."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")  # type: ignore[no-any-return]
    return request.getfixturevalue("postgres_url")  # type: ignore[no-any-return]
