"""The review page (``etl review serve``) in a real browser: Debian's chromium driven by Playwright,
against the CLI's own server process and real PostgreSQL (and SQLite, the embedded default).

A reviewer signs in as their own PostgreSQL login and sees only the tenants granted to it; the
document's text shows every extracted value's span highlighted; a correction typed with the
keyboard lands in the golden set in the reviewer's name; another tenant's item by URL is a 403 that
shows nothing of it; a POST without the session's CSRF token changes nothing; a double submit
writes one row. The screenshots in the README are taken here."""

from __future__ import annotations

import asyncio
import getpass
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from etl import run_pipeline
from etl.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "screenshots"
CHROMIUM = os.environ.get("ETL_CHROMIUM", "/usr/bin/chromium")

PIPELINE = '''
from typing import Literal

from pydantic import BaseModel

from etl import Extract, Pipeline, ReviewSampling
from etl.testing import FakeLLM, ListSource


class Receipt(BaseModel):
    company: str
    total: float | None
    currency: Literal["RM", "USD"]


def answer(request):
    lines = request.messages[-1]["content"].splitlines()
    return {"company": lines[0], "total": float(lines[-1].split()[-1]), "currency": "RM"}


def make(docs, store=None):
    return Pipeline("review", ListSource(docs), [Extract(Receipt, "Extract the receipt.", name="receipt")],
                    llm=FakeLLM(answer), review=ReviewSampling(rate=1.0), store=store)


pipeline = make([])
'''

DOCS = [
    {"id": "a1", "tenant": "acme", "text": "KEDAI ACME SDN BHD\nNO 1 JALAN MERDEKA\nTOTAL RM 12.50"},
    {"id": "a2", "tenant": "acme", "text": "ACME HARDWARE TRADING\nLOT 7 TAMAN JAYA\nTOTAL RM 48.00"},
    {"id": "a3", "tenant": "acme", "text": "ACME BOOKS ENTERPRISE\nJALAN SS2/24\nTOTAL RM 7.90"},
    {"id": "g1", "tenant": "globex", "text": "GLOBEX SECRET HOLDINGS\nTOWER 9\nTOTAL RM 999.00"},
    {"id": "g2", "tenant": "globex", "text": "GLOBEX PRIVATE CLINIC\nLEVEL 3\nTOTAL RM 150.00"},
]


def seeded(tmp_path: Path, url: str) -> Path:
    """The pipeline file the server loads, and its documents run into ``url`` (every result sampled)."""
    path = tmp_path / "review_pipeline.py"
    path.write_text(PIPELINE)
    spec = importlib.util.spec_from_file_location(f"review_pipeline_{uuid.uuid4().hex}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with ThreadPoolExecutor(1) as thread:  # Playwright's sync API holds this thread's event loop
        stats = thread.submit(asyncio.run, run_pipeline(module.make(DOCS, store=url))).result()
    assert stats.results_written == len(DOCS)
    return path


@contextmanager
def serve(pipeline: Path, url: str) -> Iterator[str]:
    """``etl review serve`` as a user starts it (port 0: the one it prints)."""
    process = subprocess.Popen([sys.executable, "-m", "etl.cli", "review", "serve", str(pipeline), "--db", url,
                                "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "COLUMNS": "400"})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/)(\S*)", line)
        assert found, line + (process.stdout.read() if process.poll() is not None else "")
        base = found.group(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base + "static/review.css", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the review server did not start"
                time.sleep(0.1)
        yield base + found.group(2)
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert shutil.which(CHROMIUM) or Path(CHROMIUM).is_file(), (
        f"no chromium at {CHROMIUM}: `apt-get install chromium` (scripts/test.sh does) or set ETL_CHROMIUM")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 860})
    opened = context.new_page()
    yield opened
    context.close()


@pytest.fixture
def reviewer(postgres_url: str) -> Iterator[str]:
    """A reviewer login (unique per test: roles are cluster-wide) granted acme only."""
    role = f"alice_{uuid.uuid4().hex[:8]}"
    owner = create_engine(postgres_url)
    cli = CliRunner()
    for args in (["analyst", "init"], ["review", "init"]):
        result = cli.invoke(app, [*args, "--db", postgres_url])
        assert result.exit_code == 0, result.output
    with owner.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw' IN ROLE etl_reviewer"))
    result = cli.invoke(app, ["analyst", "grant", role, "acme", "--db", postgres_url])
    assert result.exit_code == 0 and "may read acme" in result.output, result.output
    yield role
    with owner.begin() as conn:
        conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
    owner.dispose()


def owner_rows(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


#: A page whose keyboard shortcuts are attached (review.js is deferred: a key pressed as soon as
#: the element is parsed can come before it).
KEYS_READY = "html[data-keys=ready]"


def ids(url: str) -> dict[str, int]:
    return {key: number for key, number in owner_rows(url, "SELECT doc_key, id FROM review_queue")}


def test_a_reviewer_corrects_by_keyboard_into_the_golden_set_and_sees_only_their_tenants(
        tmp_path: Path, postgres_url: str, reviewer: str, page: Page) -> None:
    pipeline = seeded(tmp_path, postgres_url)
    items = ids(postgres_url)
    with serve(pipeline, postgres_url) as base:
        origin = base.rsplit("/", 1)[0]
        page.goto(base)
        page.fill("input[name=user]", reviewer)
        page.fill("input[name=password]", "pw")
        page.keyboard.press("Enter")
        page.wait_for_selector(KEYS_READY + " #queue")
        # the queue: acme's three items, nothing of globex (not in the rows, not in the filters)
        assert page.locator("#queue tr.row").count() == 3
        assert "GLOBEX" not in page.content() and "globex" not in page.content()
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "review-queue.png"))

        # open the first item from the keyboard; every value's span is highlighted in the text
        page.keyboard.press("Enter")
        page.wait_for_selector(KEYS_READY + " pre#text")
        assert page.url.endswith(f"/items/{items['a1']}")
        marks = {m.get_attribute("data-paths"): m.inner_text() for m in page.locator("mark.span").all()}
        assert marks == {"company": "KEDAI ACME SDN BHD", "currency": "RM", "total": "12.50"}
        assert page.locator("#model").inner_text() == "fake-llm"
        page.screenshot(path=str(SHOTS / "review-item.png"), full_page=True)

        # correct it with the keyboard: e to the first field, type, Tab, Ctrl+Enter
        page.keyboard.press("e")
        page.keyboard.type("KEDAI ACME (M) SDN BHD")
        page.keyboard.press("Tab")
        page.keyboard.press("Control+a")
        page.keyboard.type("13.50")
        page.keyboard.press("Control+Enter")
        page.wait_for_url(f"{origin}/items/{items['a2']}")
        golden = owner_rows(postgres_url, "SELECT doc_key, expected, origin, reviewer, reviewed_at FROM golden_examples")
        assert len(golden) == 1
        key, expected, source, who, when = golden[0]
        assert (key, source, who) == ("a1", "review", reviewer) and when is not None
        assert (json.loads(expected) if isinstance(expected, str) else expected) == {
            "company": "KEDAI ACME (M) SDN BHD", "total": 13.5, "currency": "RM"}
        assert owner_rows(postgres_url, "SELECT verdict, reviewer FROM review_queue WHERE doc_key = 'a1'") == [
            ("incorrect", reviewer)]

        # typed inputs from the schema: an enum is a choice of its values, a number a number field;
        # a correction the schema refuses is shown beside its field, and nothing is written
        assert page.eval_on_selector("select[name='f.currency']", "s => Array.from(s.options).map(o => o.value)") == [
            "RM", "USD"]
        assert page.get_attribute("input[name='f.total']", "type") == "number"
        token = page.get_attribute("#correct input[name=csrf]", "value")
        refused = page.request.post(f"{origin}/items/{items['a2']}", max_redirects=0, form={
            "action": "correct", "csrf": token or "", "f.company": "", "f.total": "lots", "f.currency": "EUR"})
        assert refused.status == 422
        shown = refused.text()
        assert "a number" in shown and "one of RM, USD" in shown
        assert owner_rows(postgres_url, "SELECT status FROM review_queue WHERE doc_key = 'a2'") == [("pending",)]

        # accept the next one with one key
        page.keyboard.press("Escape")
        page.keyboard.press("a")
        page.wait_for_url(f"{origin}/items/{items['a3']}")
        assert owner_rows(postgres_url, "SELECT count(*) FROM golden_examples WHERE doc_key = 'a2' AND reviewer = :r",
                          r=reviewer) == [(1,)]

        # another tenant's item by URL: 403, and nothing of it on the page
        before = owner_rows(postgres_url, "SELECT id, status, verdict FROM review_queue ORDER BY id")
        golden_before = owner_rows(postgres_url, "SELECT count(*) FROM golden_examples")
        response = page.goto(f"{origin}/items/{items['g1']}")
        assert response is not None and response.status == 403
        assert "GLOBEX" not in page.content() and "g1" not in page.inner_text("main")
        assert page.goto(f"{origin}/items/{10**6}").status == 403  # type: ignore[union-attr]  # the same for none

        # forged writes: no token, a wrong token, another tenant's item with the right token
        page.goto(f"{origin}/items/{items['a3']}")
        token = page.get_attribute("#accept input[name=csrf]", "value")
        assert token
        for form in ({"action": "accept"}, {"action": "accept", "csrf": "x" * len(token)}):
            assert page.request.post(f"{origin}/items/{items['a3']}", form=form, max_redirects=0).status == 403
        assert page.request.post(f"{origin}/items/{items['g1']}", form={"action": "accept", "csrf": token},
                                 max_redirects=0).status == 403
        assert owner_rows(postgres_url, "SELECT id, status, verdict FROM review_queue ORDER BY id") == before
        assert owner_rows(postgres_url, "SELECT count(*) FROM golden_examples") == golden_before

        # a double submit writes one row: the same form posted twice (a re-sent POST), and a
        # double click on Accept (the page's own form)
        for _ in range(2):
            sent = page.request.post(f"{origin}/items/{items['a3']}", form={"action": "accept", "csrf": token},
                                     max_redirects=0)
            assert sent.status == 303
        page.goto(f"{origin}/items/{items['a2']}")
        page.dblclick("#accept button")
        page.wait_for_url(f"{origin}/")  # nothing open is left: back to the queue, empty
        assert "Nothing to review here" in page.inner_text("main")
        assert owner_rows(postgres_url, "SELECT count(*) FROM golden_examples WHERE doc_key = 'a2'") == [(1,)]
        assert owner_rows(postgres_url, "SELECT count(*) FROM golden_examples WHERE doc_key = 'a3'") == [(1,)]
        assert owner_rows(postgres_url, "SELECT count(*) FROM golden_examples") == [(3,)]

        # the quality page: this login's tenants only, the golden set grown by review
        page.goto(f"{origin}/quality")
        golden_table = page.inner_text("#golden")
        assert "acme" in golden_table and "globex" not in page.content()
        assert page.locator("#golden tbody tr").count() == 1 and "3" in golden_table
        response = page.goto(f"{origin}/report")
        assert response is not None and response.status == 200 and "globex" not in page.content()


def test_the_database_refuses_a_reviewer_s_writes_outside_their_grants(
        tmp_path: Path, postgres_url: str, reviewer: str) -> None:
    """The page is not the guard: the same login, straight to PostgreSQL, cannot write another
    tenant's golden example, write in another reviewer's name, or touch another tenant's item."""
    seeded(tmp_path, postgres_url)
    login = create_engine(make_url(postgres_url).set(username=reviewer, password="pw"))
    attempts = [
        ("INSERT INTO golden_examples (pipeline, tenant, stage, doc_key, content, expected, origin, reviewer) "
         "VALUES ('review', 'globex', 'receipt', 'x', 't', '{}', 'review', current_user)"),
        ("INSERT INTO golden_examples (pipeline, tenant, stage, doc_key, content, expected, origin, reviewer) "
         "VALUES ('review', 'acme', 'receipt', 'x', 't', '{}', 'review', 'somebody_else')"),
        "UPDATE review_queue SET status = 'reviewed', reviewer = 'somebody_else' WHERE tenant = 'acme'",
        "DELETE FROM golden_examples",
        "UPDATE review_queue SET output = '{}' WHERE tenant = 'acme'",
    ]
    try:
        for sql in attempts:
            with pytest.raises(Exception, match="row-level security|permission denied"):
                with login.begin() as conn:
                    conn.execute(text(sql))
        with login.begin() as conn:  # another tenant's rows are not there to update
            changed = conn.execute(text("UPDATE review_queue SET status = 'reviewed', reviewer = current_user "
                                        "WHERE tenant = 'globex'")).rowcount
        assert changed == 0
    finally:
        login.dispose()
    assert owner_rows(postgres_url, "SELECT count(*) FROM review_queue WHERE status = 'reviewed'") == [(0,)]


def test_on_sqlite_the_local_user_comes_in_by_the_printed_link_only(tmp_path: Path, sqlite_url: str,
                                                                     page: Page) -> None:
    pipeline = seeded(tmp_path, sqlite_url)
    items = ids(sqlite_url)
    with serve(pipeline, sqlite_url) as link:
        origin = link.split("/login")[0]
        response = page.goto(origin + "/")
        assert response is not None and response.status == 401 and "KEDAI" not in page.content()
        assert page.goto(origin + "/login?token=wrong").status == 401  # type: ignore[union-attr]
        # another Host (a DNS-rebinding page reaching the port under its own name) is refused
        assert httpx.get(origin + "/", headers={"Host": "evil.example"}).status_code == 400
        page.goto(link)
        page.wait_for_selector(KEYS_READY + " #queue")
        assert page.locator("#queue tr.row").count() == len(DOCS)  # one user: every tenant of the file
        page.keyboard.press("Enter")
        page.wait_for_selector(KEYS_READY + " pre#text")
        page.keyboard.press("a")
        page.wait_for_url(f"{origin}/items/{items['a2']}")
        assert owner_rows(sqlite_url, "SELECT doc_key, origin, reviewer FROM golden_examples") == [
            ("a1", "review", getpass.getuser())]
        headers = page.request.get(origin + "/").headers
        assert "script-src 'self'" in headers["content-security-policy"] and headers["cache-control"] == "no-store"
