"""The review page under attack, at the HTTP level (the browser tests are in test_review_page.py),
against the CLI's own server process and real PostgreSQL. Each test pins what a hostile review of
the page found: a NUL in the login name that cut libpq's connection string short and let the
server's own credentials in; the owner signing in past row-level security; a revoked login keeping
its session; a chunked body read whole before any check; unlimited password guesses; a "one-time"
link that worked forever; 500s for non-ASCII tokens and NUL filters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from etl.cli.app import app
from tests.integration.test_review_page import ROOT, seeded


@contextmanager
def serving(pipeline: Path, url: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``etl review serve`` on port 0: (the link it printed, the process, whose later lines can be read)."""
    process = subprocess.Popen([sys.executable, "-m", "etl.cli", "review", "serve", str(pipeline), "--db", url,
                                "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "COLUMNS": "400", **(env or {})})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/)(\S*)", line)
        assert found, line + (process.stdout.read() if process.poll() is not None else "")
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(found.group(1) + "static/review.css", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the review server did not start"
                time.sleep(0.1)
        yield found.group(0), process
    finally:
        process.terminate()
        process.wait(timeout=10)


def sign_in(client: httpx.Client, user: str, password: str) -> int:
    form = client.get("/login")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert form.status_code == 200 and nonce, form.text[:300]
    return client.post("/login", data={"csrf": nonce.group(1), "user": user, "password": password}).status_code


@pytest.fixture
def reviewers(postgres_url: str) -> Iterator[tuple[str, str]]:
    """Two reviewer logins granted acme (unique per test: roles are cluster-wide)."""
    names = (f"rev_{uuid.uuid4().hex[:8]}", f"rev_{uuid.uuid4().hex[:8]}")
    cli = CliRunner()
    for args in (["analyst", "init"], ["review", "init"]):
        result = cli.invoke(app, [*args, "--db", postgres_url])
        assert result.exit_code == 0, result.output
    owner = create_engine(postgres_url)
    with owner.begin() as conn:
        for name in names:
            conn.execute(text(f"CREATE ROLE {name} LOGIN PASSWORD 'pw' IN ROLE etl_reviewer"))
    for name in names:
        assert cli.invoke(app, ["analyst", "grant", name, "acme", "--db", postgres_url]).exit_code == 0
    yield names
    with owner.begin() as conn:
        for name in names:
            conn.execute(text(f"DROP ROLE IF EXISTS {name}"))
    owner.dispose()


def backends(url: str, role: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE usename = :r"), {"r": role})
                       .scalar_one())
    finally:
        engine.dispose()


def test_only_a_reviewer_s_own_password_signs_in(tmp_path: Path, postgres_url: str,
                                                 reviewers: tuple[str, str]) -> None:
    """The server is given the owner's password the way libpq users often do (PGPASSWORD, the URL
    without one); a login name with a NUL used to cut the connection string before the password,
    port and options, so libpq fell back to PGPASSWORD and let anyone in as the owner."""
    pipeline = seeded(tmp_path, postgres_url)
    parsed = make_url(postgres_url)
    schema = parsed.query["options"].split("=", 1)[1]
    env = {"PGPASSWORD": str(parsed.password), "PGPORT": str(parsed.port), "PGOPTIONS": f"-csearch_path={schema}"}
    alice, _ = reviewers
    with serving(pipeline, parsed.set(password=None).render_as_string(hide_password=False), env) as (link, _):
        origin = link.split("/login")[0]
        with httpx.Client(base_url=origin) as client:
            assert sign_in(client, f"{parsed.username}\x00", "a guess") == 401
            assert client.get("/").status_code == 303  # not signed in
        with httpx.Client(base_url=origin) as client:  # the owner, with its right password: not here
            assert sign_in(client, str(parsed.username), str(parsed.password)) == 401
        for user, password in ((alice, ""), (alice, "pw\x00"), (alice + "\n", "pw"), ("x" * 64, "pw")):
            with httpx.Client(base_url=origin) as client:
                assert sign_in(client, user, password) == 401, (user, password)
        with httpx.Client(base_url=origin) as client:
            assert sign_in(client, alice, "pw") == 303
            assert client.get("/").status_code == 200
            assert backends(postgres_url, alice) == 0  # a session holds no idle connection


def test_a_revoked_login_is_out_at_its_next_request(tmp_path: Path, postgres_url: str,
                                                    reviewers: tuple[str, str]) -> None:
    pipeline = seeded(tmp_path, postgres_url)
    alice, bob = reviewers
    with serving(pipeline, postgres_url) as (link, _):
        origin = link.split("/login")[0]
        with httpx.Client(base_url=origin) as client:
            assert sign_in(client, alice, "pw") == 303 and client.get("/").status_code == 200
            owner = create_engine(postgres_url)
            with owner.begin() as conn:
                conn.execute(text(f"ALTER ROLE {alice} NOLOGIN"))
            owner.dispose()
            assert client.get("/").status_code == 401
            assert client.get("/").status_code == 303  # the session was ended: to the sign-in form
        # guessing: five failures for a login, then it is refused unchecked for a minute
        with httpx.Client(base_url=origin) as client:
            assert [sign_in(client, bob, f"guess {n}") for n in range(5)] == [401] * 5
            assert sign_in(client, bob, "pw") == 429


def test_bodies_are_read_only_up_to_the_limit_and_odd_inputs_get_answers_not_500s(
        tmp_path: Path, postgres_url: str, reviewers: tuple[str, str]) -> None:
    pipeline = seeded(tmp_path, postgres_url)
    alice, _ = reviewers
    with serving(pipeline, postgres_url) as (link, process):
        origin = link.split("/login")[0]

        def peak_mib() -> float:
            status = Path(f"/proc/{process.pid}/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

        def chunked(mib: int) -> Iterator[bytes]:
            block = b"a" * (1 << 20)
            for _ in range(mib):
                yield block

        before = peak_mib()
        with httpx.Client(base_url=origin) as client:
            assert sign_in(client, alice, "pw") == 303
            item = re.search(r'href="/items/(\d+)', client.get("/").text)
            assert item
            for path in ("/logout", f"/items/{item.group(1)}"):  # signed in: the body is read, up to 1 MiB
                try:
                    answered = client.post(path, content=chunked(200), headers={
                        "Content-Type": "application/x-www-form-urlencoded"}).status_code
                except httpx.TransportError:
                    answered = None  # the server answered and closed while the client still sent: fine
                assert answered in (403, None), answered
            assert peak_mib() - before < 50, (before, peak_mib())  # 400 MiB sent, not held
            # a token with characters hmac will not compare as str, a NUL filter: answers, not 500s
            assert client.post("/logout", data={"csrf": "é"}).status_code == 403
            assert client.get("/", params={"tenant": "\x00", "status": "\x00"}).status_code == 200
        with httpx.Client(base_url=origin) as client:
            assert client.post("/login", data={"csrf": "é", "user": alice, "password": "pw"}).status_code == 403


def test_the_local_link_lets_the_local_user_in_once(tmp_path: Path, sqlite_url: str) -> None:
    pipeline = seeded(tmp_path, sqlite_url)
    with serving(pipeline, sqlite_url) as (link, process):
        with httpx.Client() as first:
            assert first.get(link).status_code == 303 and first.get(link.split("/login")[0] + "/").status_code == 200
        with httpx.Client() as second:
            assert second.get(link).status_code == 401  # used: the link in a browser's history is dead
            assert second.get(link.split("token=")[0] + "token=é").status_code == 401
            assert process.stdout is not None
            fresh = re.search(r"the next sign-in: (\S+)", process.stdout.readline())
            assert fresh and second.get(fresh.group(1)).status_code == 303
