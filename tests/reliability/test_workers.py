"""Worker processes and probes, through the real CLI on real Kafka and PostgreSQL: ``etl run
--workers 2`` restarts a SIGKILLed child with nothing lost or duplicated; the drain deadline exits a
worker whose calls will not finish, and a restart resumes exactly; ``/readyz`` is false while
PostgreSQL is down and true after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from connectors.store import make_engine, upgrade
from tests.conftest import ROOT
from tests.helpers import end_offsets, produce, rows
from tests.reliability.test_operations import free_port

PIPELINE = str(Path(__file__).with_name("pipeline.py"))
SERVICES = str(ROOT / "services" / "services.sh")
N, UNIQUE, IN_FLIGHT = 2000, 1500, 32


def environment(kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path, latency_s: float) -> dict[str, str]:
    return {**os.environ, "ETL_DATABASE_URL": postgres_url, "ETL_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "ETL_KAFKA_SESSION_TIMEOUT_MS": "6000", "ETL_MAX_IN_FLIGHT": str(IN_FLIGHT), "RELIABILITY_TOPIC": topic,
            "RELIABILITY_CALL_LOG": str(tmp_path / "calls.log"), "RELIABILITY_LATENCY_S": str(latency_s),
            "ETL_CLAIM_LEASE_S": "5", "ETL_LOG_LEVEL": "warning"}


def tickets(kafka_bootstrap: str, topic: str) -> None:
    produce(kafka_bootstrap, topic, [
        (None, json.dumps({"id": f"w{i}", "tenant": "acme", "text": f"ticket {i % UNIQUE}"}).encode()) for i in range(N)])


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def committed(url: str) -> int:
    return sum(p for (p,) in rows(url, "SELECT next_offset FROM source_positions WHERE pipeline = 'reliability'"))


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_sigkilled_worker_is_restarted_and_nothing_is_lost_or_duplicated(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path) -> None:
    tickets(kafka_bootstrap, topic)
    upgrade(make_engine(postgres_url))
    port = free_port()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "etl.cli", "run", PIPELINE, "--workers", "2", "--stop-when-idle", "5",
         "--metrics-port", str(port)], env=environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.05), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(children(supervisor.pid)) == 2, 60, "two workers did not start")
        first = children(supervisor.pid)
        wait_for(lambda: committed(postgres_url) >= 300, 120, "no progress")
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).json()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        victim = min(first)
        os.kill(victim, signal.SIGKILL)  # mid-run: its in-flight calls are lost with it
        wait_for(lambda: len(children(supervisor.pid) - first) == 1, 60, "the killed worker was not restarted")
        out, err = supervisor.communicate(timeout=300)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == 0, err[-3000:]
    assert ready["ok"] and ready["workers_reporting"] == 2, ready
    assert 'worker="0"' in metrics and 'worker="1"' in metrics, metrics[:2000]  # both children's series
    assert "1 restarts" in out, out
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == end_offsets(
        kafka_bootstrap, topic)
    assert rows(postgres_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results") == [(N, N)]
    calls = len((tmp_path / "calls.log").read_text().splitlines())
    assert UNIQUE <= calls <= UNIQUE + IN_FLIGHT, calls  # one per content, plus what the kill lost
    print(f"\nworkers figures: messages={N} unique={UNIQUE} calls={calls} (lost with the kill: {calls - UNIQUE})")


def test_the_drain_deadline_exits_a_stuck_worker_and_a_restart_resumes_exactly(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path) -> None:
    tickets(kafka_bootstrap, topic)
    upgrade(make_engine(postgres_url))
    env = environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.05)
    # calls of about 10 s: when the signal comes, 32 are in flight and cannot all finish in 2 s
    worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE], cwd=ROOT, text=True,
                              env={**env, "ETL_DRAIN_TIMEOUT_S": "2", "RELIABILITY_LATENCY_S": "10"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: committed(postgres_url) > 0, 120, "no progress")
        worker.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = worker.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 3, (worker.returncode, err[-3000:])  # the deadline's exit
    assert "drain deadline (2 s) passed" in out + err and took < 2 + 5, took
    positions = committed(postgres_url)
    assert 0 < positions < N and rows(postgres_url, "SELECT count(*) FROM stage_results")[0][0] >= positions
    resumed = subprocess.run([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--stop-when-idle", "4"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(postgres_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results") == [(N, N)]
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == end_offsets(
        kafka_bootstrap, topic)
    calls = len((tmp_path / "calls.log").read_text().splitlines())
    assert calls <= UNIQUE + IN_FLIGHT, calls  # the unfinished calls are paid again, nothing else


def test_readyz_is_false_while_postgres_is_down_and_true_after(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path) -> None:
    upgrade(make_engine(postgres_url))
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--metrics-port", str(port)],
                              env=environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.05), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probe = f"http://127.0.0.1:{port}"

    def answer(path: str) -> tuple[int, dict[str, object]]:
        try:
            response = httpx.get(probe + path, timeout=10)
        except httpx.TransportError:
            return 0, {}
        return response.status_code, response.json()

    try:
        wait_for(lambda: answer("/readyz")[0] == 200, 90, "the worker never became ready")
        subprocess.run([SERVICES, "stop-postgres"], check=True, capture_output=True, timeout=120)
        try:
            status, body = answer("/readyz")
            assert status == 503 and body["store"]["ok"] is False, body  # type: ignore[index]
            assert answer("/healthz")[0] == 200  # alive: waiting out the database is not a reason to restart
        finally:
            subprocess.run([SERVICES, "start-postgres"], check=True, capture_output=True, timeout=180)
        wait_for(lambda: answer("/readyz")[0] == 200, 60, "not ready again after PostgreSQL came back")
        tickets(kafka_bootstrap, topic)  # and it still works
        wait_for(lambda: rows(postgres_url, "SELECT count(*) FROM stage_results")[0][0] == N, 120, "not processed")
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, err[-3000:]
