"""The review app: a queue of sampled items, an item page (the text with every value's span
highlighted, the answer, accept / correct / skip by keyboard), a quality page, the report.

Access is the database's. On PostgreSQL a reviewer signs in as their own login; the app keeps
the password only in that session's connection pool (in this process's memory, never in a page or
a cookie) and reads and writes through it, so the row-level security and grants analysts have
decide what exists for the reviewer, and the write policies (``etl review init``) decide what they
may record, in their own name. On SQLite (the embedded default) there is one local user, let in
by the single-use link ``etl review serve`` prints (a fresh one is printed each time one is used).

A sign-in is refused for the tables' owner, a superuser and a role that bypasses row-level security
(the owner corrects through ``etl review import``), and for a login name or password holding NUL or
control characters (libpq would read a connection string cut short); the connection demands the
server's password check (``require_auth``) and reads no password file, so a login is never let in
by credentials this process holds. Session connections are not pooled: each request connects as
the login, so a revoked or locked login is out at its next request, and sign-ins hold no idle
connections. Sessions end after 8 idle hours or 12 in all, at most 5 per login (the oldest is
closed); after 5 failed sign-ins for a login (30 from an address) in a minute, the next is refused.

Every write is a POST carrying the session's CSRF token (compared in constant time); a body is read
only up to 1 MiB, after the cookie has been checked; the session
cookie is HttpOnly, SameSite=Strict and Secure over HTTPS; pages are sent with a Content-Security-Policy that allows
only this app's own script and style, and are never cached. Requests for another Host are refused
(a DNS-rebinding page cannot reach the app through a name it controls).
"""

from __future__ import annotations

import getpass
import hmac
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import structlog
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError
from sqlalchemy.pool import NullPool
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from connectors.store import make_engine
from etl.pipeline import Pipeline
from etl.quality.review import ItemChanged, Verdict, record
from etl.web import forms
from etl.web import store as data

log = structlog.get_logger()
HERE = Path(__file__).parent
COOKIE = "etl_review"
LOGIN_COOKIE = "etl_review_login"
IDLE_S = 8 * 3600
LIFETIME_S = 12 * 3600
PER_LOGIN = 5
MAX_SESSIONS = 1000
MAX_FORM = 1 << 20  # a correction is small; a larger body is refused unread
#: Failed sign-ins within WINDOW_S before the next is refused: per login name, per client address
#: (higher: an office shares one).
FAILURES, CLIENT_FAILURES, WINDOW_S = 5, 30, 60.0
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}


@dataclass
class Session:
    login: str
    engine: Engine
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    seen: float = field(default_factory=time.monotonic)
    opened: float = field(default_factory=time.monotonic)


class Sessions:
    """Signed-in reviewers by a random session id (the cookie); idle and old ones are closed, and a
    login's sixth session closes its oldest."""

    def __init__(self, shared: Engine | None = None) -> None:
        self._by_id: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._shared = shared  # SQLite's one engine: every local session's, never closed with one

    def open(self, session: Session) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            mine = [k for k, s in self._by_id.items() if s.login == session.login]
            for oldest in mine[:max(0, len(mine) - PER_LOGIN + 1)]:  # dicts keep insertion order
                self._close(oldest)
            for oldest in list(self._by_id)[:max(0, len(self._by_id) - MAX_SESSIONS + 1)]:
                self._close(oldest)
            self._by_id[sid] = session
        return sid

    def get(self, sid: str | None) -> Session | None:
        now = time.monotonic()
        with self._lock:
            for stale in [k for k, s in self._by_id.items() if now - s.seen > IDLE_S or now - s.opened > LIFETIME_S]:
                self._close(stale)
            session = self._by_id.get(sid or "")
            if session is not None:
                session.seen = now
            return session

    def close(self, sid: str | None) -> None:
        with self._lock:
            self._close(sid or "")

    def _close(self, sid: str) -> None:
        session = self._by_id.pop(sid, None)
        if session is not None and session.engine is not self._shared:
            session.engine.dispose()


class Throttle:
    """Sign-in attempts per login name and per client address in the last ``WINDOW_S``. An attempt
    is counted when it starts (checked and recorded under one lock, so concurrent guesses cannot all
    pass before the first fails) and forgotten if it succeeds; past ``FAILURES``
    (``CLIENT_FAILURES``) the next is refused unchecked, so guessing a login's password runs at 5 a
    minute. Keys whose attempts are all older than the window are dropped; while more than
    ``MAX_KEYS`` keys are live (a flood of names) every new attempt is refused rather than any
    login's count forgotten."""

    MAX_KEYS = 100_000

    def __init__(self) -> None:
        self._attempts: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def begin(self, login: str, client: str) -> float | None:
        """The attempt's mark, to pass to :meth:`succeeded`; None: refused (too many)."""
        now = time.monotonic()
        keys = ((f"login:{login}", FAILURES), (f"client:{client}", CLIENT_FAILURES))
        with self._lock:
            if len(self._attempts) > self.MAX_KEYS:
                self._attempts = {k: v for k, v in self._attempts.items() if now - v[-1] < WINDOW_S}
                if len(self._attempts) > self.MAX_KEYS:
                    return None
            for key, most in keys:
                recent = [t for t in self._attempts.get(key, []) if now - t < WINDOW_S]
                self._attempts[key] = recent
                if len(recent) >= most:
                    return None
            for key, _ in keys:
                self._attempts[key].append(now)
            return now

    def succeeded(self, login: str, client: str, mark: float) -> None:
        with self._lock:
            for key in (f"login:{login}", f"client:{client}"):
                if mark in self._attempts.get(key, []):
                    self._attempts[key].remove(mark)


def same(given: str, expected: str) -> bool:
    """Constant-time comparison of a token the client sent (any characters) with ours."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def credentials_problem(user: str, password: str) -> str | None:
    """Why a login name and password are not even tried: empty (libpq would fall back to this
    process's PGPASSWORD), or holding a NUL or control character (libpq's connection string would
    end at a NUL, dropping the password and every setting after it), or a name PostgreSQL cannot
    have (over 63 bytes)."""
    if not user or not password:
        return "empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in user + password):
        return "control character"
    if len(user.encode("utf-8", "surrogatepass")) > 63:
        return "name too long"
    return None


class Headers:
    """Adds the page headers to every response (pure ASGI: no buffering of bodies)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(
                    (k.lower().encode(), v.encode()) for k, v in PAGE_HEADERS.items() if k.lower().encode() not in present)]
            await send(message)

        await self.app(scope, receive, with_headers)


def create_app(pipeline: Pipeline, db_url: str, *, allowed_hosts: list[str], local_token: str | None = None,
               new_token: Any = None) -> Starlette:
    """The review app over the store at ``db_url`` for ``pipeline``'s items. PostgreSQL: reviewers
    sign in with their own login. SQLite: ``local_token`` lets the one local user in, once; then
    ``new_token(token)`` is called with the next one (``etl review serve`` prints its link)."""
    postgres = make_url(db_url).get_backend_name() == "postgresql"
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals["shown"] = forms.shown
    local_engine = None if postgres else make_engine(db_url)
    sessions = Sessions(local_engine)
    throttle = Throttle()
    token = [local_token]
    secret = secrets.token_bytes(32)  # signs sign-in form nonces: a cookie set by another site is not one
    stages = {s.name: s for s in pipeline.stages}

    def nonce() -> str:
        value = secrets.token_urlsafe(24)
        return f"{value}.{hmac.new(secret, value.encode(), 'sha256').hexdigest()}"

    def signed(value: str) -> bool:
        head, _, mac = value.partition(".")
        return bool(head) and same(mac, hmac.new(secret, head.encode(), "sha256").hexdigest())

    def cookie(request: Request, response: Response, name: str, value: str) -> None:
        response.set_cookie(name, value, httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")

    def page(request: Request, name: str, session: Session | None, status: int = 200, **context: Any) -> Response:
        return templates.TemplateResponse(request, name, {"session": session, "pipeline": pipeline.name,
                                                          "postgres": postgres, **context}, status_code=status)

    def refused(request: Request, session: Session | None, status: int, message: str) -> Response:
        return page(request, "message.html", session, status, title="Not allowed" if status == 403 else "Error",
                    message=message)

    async def form_of(request: Request) -> dict[str, str] | None:
        """The POSTed form, or None: a body over ``MAX_FORM`` is not read past it (a chunked body
        says no length first), one that is not UTF-8 form data is refused."""
        try:
            if int(request.headers.get("content-length") or 0) > MAX_FORM:
                return None
        except ValueError:
            return None
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_FORM:
                return None
        try:
            parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=500)
        except (UnicodeDecodeError, ValueError):
            return None
        return {k: v[-1] for k, v in parsed.items()}

    def current(request: Request) -> Session | None:
        return sessions.get(request.cookies.get(COOKIE))

    def signed_in(request: Request, response: Response, session: Session) -> Response:
        cookie(request, response, COOKIE, sessions.open(session))
        response.delete_cookie(LOGIN_COOKIE, path="/")
        return response

    async def login(request: Request) -> Response:
        if not postgres:
            given = request.query_params.get("token", "")
            if token[0] and given and same(given, token[0]):
                token[0] = secrets.token_urlsafe(24)  # used: the next sign-in needs the next link
                if new_token is not None:
                    new_token(token[0])
                return signed_in(request, RedirectResponse("/", 303), Session(getpass.getuser(), local_engine))  # type: ignore[arg-type]
            return refused(request, None, 401, "Open the newest link `etl review serve` printed (each lets the "
                                               "local user in once).")
        if request.method == "GET":
            fresh = nonce()
            response = page(request, "login.html", None, nonce=fresh, problem=None)
            cookie(request, response, LOGIN_COOKIE, fresh)
            return response
        client = request.client.host if request.client else ""
        sent = request.cookies.get(LOGIN_COOKIE, "")
        if not sent or not signed(sent):  # before the body is read: no form is read for a stranger
            return refused(request, None, 403, "The sign-in form expired or was not this app's: open /login again.")
        form = await form_of(request) or {}
        if not same(form.get("csrf", ""), sent):
            return refused(request, None, 403, "The sign-in form expired or was not this app's: open /login again.")
        user, password = form.get("user", "")[:200], form.get("password", "")
        mark = throttle.begin(user, client)
        if mark is None:
            log.warning("review sign-in throttled", login=user, client=client)
            return refused(request, None, 429, "Too many failed sign-ins: wait a minute and try again.")
        session = await _connect(db_url, user, password)
        if session is None:
            fresh = nonce()
            response = page(request, "login.html", None, 401, nonce=fresh,
                            problem="Sign-in refused: check the login and password, and that the owner ran "
                                    f"`GRANT etl_reviewer TO \"{user}\"` and `etl analyst grant` (the tables' "
                                    "owner and superusers review with `etl review import`).")
            cookie(request, response, LOGIN_COOKIE, fresh)
            return response
        throttle.succeeded(user, client, mark)
        log.info("review sign-in", login=session.login)
        return signed_in(request, RedirectResponse("/", 303), session)

    async def logout(request: Request) -> Response:
        session = current(request)
        if session is None:
            return refused(request, session, 403, "Sign-out needs this app's own form.")
        form = await form_of(request) or {}
        if not same(form.get("csrf", ""), session.csrf):
            return refused(request, session, 403, "Sign-out needs this app's own form.")
        sessions.close(request.cookies.get(COOKIE))
        response = RedirectResponse("/login" if postgres else "/signed-out", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    def need(request: Request) -> Session | Response:
        session = current(request)
        if session is not None:
            return session
        if postgres:
            return RedirectResponse("/login", 303)
        if request.query_params.get("token"):
            return RedirectResponse(f"/login?token={request.query_params['token']}", 303)
        return refused(request, None, 401, "Open the link `etl review serve` printed (it lets the local user in).")

    async def queue(request: Request) -> Response:
        session = need(request)
        if isinstance(session, Response):
            return session
        filters = data.Filters.of(request.query_params)
        items, choices, total = await _run(data.queue, session.engine, pipeline.name, filters)
        return page(request, "queue.html", session, items=items, choices=choices, filters=filters, total=total,
                    limit=data.QUEUE_LIMIT)

    async def show(request: Request, problems: dict[str, str] | None = None, entered: dict[str, str] | None = None,
                   status: int = 200) -> Response:
        session = need(request)
        if isinstance(session, Response):
            return session
        item = await _item(session, request)
        if item is None:
            return refused(request, session, 403, "There is no review item with this id that you may open.")
        stage = stages.get(item["stage"])
        fields = forms.fields(stage.output_model) if stage is not None else []
        filters = data.Filters.of(request.query_params)
        return page(request, "item.html", session, status, item=item, fields=fields, problems=problems or {},
                    entered=entered, segments=data.segments(item["content"], item["spans"]), filters=filters,
                    spans={s["path"]: s for s in item["spans"]}, known_stage=stage is not None)

    async def _item(session: Session, request: Request) -> dict[str, Any] | None:
        try:
            item_id = int(request.path_params["item_id"])
        except ValueError:
            return None
        if not -(1 << 63) <= item_id < 1 << 63:
            return None
        return await _run(data.item, session.engine, pipeline.name, item_id)

    async def decide(request: Request) -> Response:
        session = current(request)
        form = await form_of(request) if session is not None else None
        if session is None or form is None or not same(form.get("csrf", ""), session.csrf):
            log.warning("review write refused: no session or CSRF token", path=request.url.path)
            return refused(request, session, 403, "This form was not sent by your review page (its token is missing "
                                                  "or stale): nothing was recorded. Reload the item and try again.")
        item = await _item(session, request)
        if item is None:
            return refused(request, session, 403, "There is no review item with this id that you may open.")
        filters = data.Filters.of(request.query_params)
        action = form.get("action")
        if action == "correct":
            stage = stages.get(item["stage"])
            if stage is None:
                return refused(request, session, 400, f"stage {item['stage']!r} is not in pipeline {pipeline.name!r}: "
                                                      "serve the pipeline it came from to correct it")
            corrected, problems = forms.read(stage.output_model, form)
            if problems:
                return await show(request, problems, form, 422)
            verdict = Verdict(item, "incorrect", corrected, session.login)
        elif action == "accept":
            verdict = Verdict(item, "correct", None, session.login)
        elif action != "skip":
            return refused(request, session, 400, "Unknown action: accept, correct or skip.")
        if action != "skip":
            try:
                await _run(_record, session, verdict)
            except (ItemChanged, DBAPIError) as exc:
                log.warning("review write refused", login=session.login, item=item["id"], error=str(exc).splitlines()[0])
                return refused(request, session, 403, "This item could not be recorded under your login (it changed, "
                                                      "or your login may not review its tenant): nothing was recorded.")
        after = await _run(data.neighbour, session.engine, pipeline.name, filters, item["id"])
        query = f"?{filters.query()}" if filters.query() else ""
        return RedirectResponse(f"/items/{after}{query}" if after is not None else f"/{query}", 303)

    async def quality(request: Request) -> Response:
        session = need(request)
        if isinstance(session, Response):
            return session
        return page(request, "quality.html", session, **await _run(data.quality, session.engine, pipeline.name))

    async def report(request: Request) -> Response:
        """The quality report (``etl report``) drawn from what this login may read."""
        session = need(request)
        if isinstance(session, Response):
            return session
        from etl.quality.report import write_report  # noqa: PLC0415

        def draw() -> str:
            with tempfile.TemporaryDirectory() as out:
                return write_report(session.engine, Path(out), pipeline.name).read_text(encoding="utf-8")

        # The report is one self-contained page with its own inline styles and no script.
        return HTMLResponse(await _run(draw), headers={
            "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"})

    async def signed_out(request: Request) -> Response:
        return refused(request, None, 200, "Signed out. Open the link `etl review serve` printed to come back.")

    def _record(session: Session, verdict: Verdict) -> None:
        with session.engine.begin() as conn:
            record(conn, [verdict], datetime.now(timezone.utc), promote=True)

    async def connection_refused(request: Request, exc: Exception) -> Response:
        """A session whose login can no longer connect (locked, renamed, its password changed, or
        the database down) is ended: sign in again."""
        if not postgres:
            return refused(request, current(request), 503, "The store is busy or unreachable: try again.")
        log.warning("review session ended: its connection was refused", error=str(exc).splitlines()[0][:200])
        sessions.close(request.cookies.get(COOKIE))
        response = refused(request, None, 401, "Your login's connection to the database was refused (the login "
                                               "changed, or the database is down): sign in again.")
        response.delete_cookie(COOKIE, path="/")
        return response

    async def read_refused(request: Request, exc: Exception) -> Response:
        """The database refused this login a read or write it used to allow (a grant or the
        reviewer role revoked since sign-in): a page that says so, not a 500."""
        log.warning("review request refused by the database", error=str(exc).splitlines()[0][:200])
        return refused(request, current(request), 403, "The database refused your login this page (a grant may have "
                                                       "been revoked): nothing was recorded.")

    routes = [
        Route("/", queue), Route("/login", login, methods=["GET", "POST"]), Route("/logout", logout, methods=["POST"]),
        Route("/signed-out", signed_out), Route("/items/{item_id}", show, methods=["GET"]),
        Route("/items/{item_id}", decide, methods=["POST"]), Route("/quality", quality), Route("/report", report),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={OperationalError: connection_refused, ProgrammingError: read_refused}, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts),
                                                Middleware(Headers)])


async def _run(fn: Any, *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool  # noqa: PLC0415

    return await run_in_threadpool(fn, *args)


async def _connect(db_url: str, user: str, password: str) -> Session | None:
    """A session for a PostgreSQL login that may review, or None (wrong password, no such login, or
    not a reviewer: the page says the same for each)."""
    from connectors.store.security import is_reviewer  # noqa: PLC0415

    if (problem := credentials_problem(user, password)) is not None:
        log.info("review sign-in refused", login=user[:100], error=problem)
        return None

    def connect() -> Session | None:
        # Not pooled: every request connects as the login (a revoked one is out at once, and an idle
        # session holds no connection). The server must check the password; no password file.
        engine = create_engine(make_url(db_url).set(username=user, password=password), poolclass=NullPool,
                               connect_args={"require_auth": "scram-sha-256,md5,password", "passfile": os.devnull,
                                             "gssencmode": "disable", "connect_timeout": 10})
        try:
            with engine.connect() as conn:
                login = str(conn.execute(text("SELECT current_user")).scalar_one())
                if is_reviewer(conn, login):
                    return Session(login, engine)
        except DBAPIError as exc:
            log.info("review sign-in refused", login=user, error=str(exc).splitlines()[0][:200])
        engine.dispose()
        return None

    return await _run(connect)  # type: ignore[no-any-return]
