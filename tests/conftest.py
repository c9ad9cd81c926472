"""Shared fixtures. Services are real: PostgreSQL from services/services.sh (or testcontainers where
Docker works). A test that needs a missing service fails loudly; nothing is skipped in CI."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from etl.log import configure

ROOT = Path(__file__).resolve().parents[1]

# Tests read warnings and failures, not every flush; set ETL_LOG_LEVEL=debug to see them.
configure(os.environ.get("ETL_LOG_LEVEL", "warning"))
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
    admin = create_engine(postgres_server, pool_pre_ping=True)  # survives a server restart in a test
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in postgres_server else "?"
    yield f"{postgres_server}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """A real Kafka broker: ETL_TEST_KAFKA (set by services/services.sh), else testcontainers."""
    bootstrap = os.environ.get("ETL_TEST_KAFKA")
    if bootstrap:
        yield bootstrap
        return
    if _docker_works():
        from testcontainers.kafka import KafkaContainer  # noqa: PLC0415

        with KafkaContainer("apache/kafka:4.4.0").with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    pytest.fail("no Kafka: run `services/services.sh start` and `eval \"$(services/services.sh env)\"`, "
                "or use scripts/test.sh which does both")


@pytest.fixture
def topic(kafka_bootstrap: str) -> Iterator[str]:
    """A fresh 4-partition topic (and its DLQ topic) for one test."""
    from kafka.admin import KafkaAdminClient, NewTopic  # noqa: PLC0415

    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(name, 4, 1), NewTopic(f"{name}.dlq", 1, 1)])
    yield name
    admin.delete_topics([name, f"{name}.dlq"])
    admin.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'etl.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Each store test runs on the embedded default and on real PostgreSQL."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")  # type: ignore[no-any-return]
    return request.getfixturevalue("postgres_url")  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _collect_dropped_engines() -> Iterator[None]:
    """An engine a test drops (an in-process CLI command's, a helper's) keeps its pooled PostgreSQL
    connections until the cyclic garbage collector frees it, and full collections come rarely: the
    whole suite once held 97 idle connections and PostgreSQL refused the next (max_connections 100).
    Collected after each test, a test holds none past its end."""
    yield
    gc.collect()
