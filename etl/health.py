"""One port for an orchestrator: ``/healthz``, ``/readyz`` and ``/metrics`` (``etl run --metrics-port``).

- ``/healthz``: the process is alive and its event loop is turning (the runner's loop beats at least
  every 50 ms; one silent for ``ETL_STALL_S`` is stuck). Start-up (migrations, waiting for the store,
  joining the group) is alive: it has its own bound (``ETL_STORE_RETRY_S``), after which the run
  exits, and an orchestrator that restarted a worker still waiting for its store would only wait
  again. 200 or 503.
- ``/readyz``: the store answers a query, the source has partitions assigned (a Kafka member still
  joining its group is not ready), the loop is turning, and the worker is not draining. 200 or 503,
  with each check's answer as JSON.
- ``/metrics``: the Prometheus registry (under ``etl run --workers N``, every child's, merged by
  ``prometheus_client``'s multiprocess collector).

Served from a thread, so a busy loop cannot hold a probe; bound to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any



class Probe:
    """What one worker reports to its probes: set by the runner's loop, read by the HTTP thread."""

    def __init__(self, stall_s: float = 30.0) -> None:
        self.stall_s = stall_s  # a loop silent this long is stuck: /healthz answers 503
        self.beat: float | None = None  # None: starting, the loop has not turned yet
        self.assigned = False
        self.draining = False

    def tick(self, assigned: bool) -> None:
        self.beat = time.monotonic()
        self.assigned = assigned

    def alive(self) -> dict[str, Any]:
        if self.beat is None:
            return {"ok": True, "starting": True}
        age = time.monotonic() - self.beat
        return {"ok": age < self.stall_s, "loop_age_s": round(age, 3)}

    def ready(self) -> dict[str, Any]:
        alive = self.alive()
        return {"ok": alive["ok"] and self.assigned and not self.draining, "loop": alive["ok"],
                "partitions_assigned": self.assigned, "draining": self.draining}


def store_check(url: str) -> Callable[[], dict[str, Any]]:
    """A check that the store answers ``SELECT 1`` within a few seconds, through its own connection
    (not the run's pool: a probe must not take a connection a commit is waiting for)."""
    from sqlalchemy import create_engine, text  # noqa: PLC0415
    from sqlalchemy.engine import make_url  # noqa: PLC0415
    from sqlalchemy.pool import NullPool  # noqa: PLC0415

    postgres = make_url(url).get_backend_name() == "postgresql"
    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 3} if postgres else {})

    def check() -> dict[str, Any]:
        try:
            with engine.connect() as conn:
                if postgres:
                    conn.exec_driver_sql("SET statement_timeout = 3000")
                conn.execute(text("SELECT 1"))
            return {"ok": True}
        except Exception as exc:  # noqa: BLE001 - any failure is "not ready", said in one line
            return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}

    return check


def serve(port: int, host: str, alive: Callable[[], dict[str, Any]], ready: Callable[[], dict[str, Any]],
          store: Callable[[], dict[str, Any]] | None, metrics: Callable[[], bytes]) -> ThreadingHTTPServer:
    """Starts the probe server on host:port in a daemon thread; returns it (``shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST  # noqa: PLC0415

                self._send(200, metrics(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                answer = alive()
                self._json(answer)
            elif path == "/readyz":
                answer = ready()
                if store is not None:
                    answer["store"] = store()
                    answer["ok"] = answer["ok"] and answer["store"]["ok"]
                self._json(answer)
            else:
                self._send(404, b"not found: /healthz, /readyz, /metrics\n", "text/plain")

        def _json(self, answer: dict[str, Any]) -> None:
            self._send(200 if answer["ok"] else 503, json.dumps(answer).encode() + b"\n", "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="etl-probes", daemon=True).start()
    return server


def registry_metrics() -> bytes:
    """This process's registry, or every worker's when ``PROMETHEUS_MULTIPROC_DIR`` is set."""
    import os  # noqa: PLC0415

    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess  # noqa: PLC0415

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY)
