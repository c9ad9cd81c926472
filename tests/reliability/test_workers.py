"""Worker processes and probes, through the real CLI on real Kafka and PostgreSQL: ``etl run
--workers 2`` restarts a SIGKILLed child and a hung (SIGSTOPped) one with nothing lost or
duplicated; the drain deadline exits a worker whose calls will not finish (exit 3, from the
supervisor too), and a restart resumes exactly; ``/readyz`` is false while PostgreSQL is down and
true after; a worker stopped while it waits for its store at start-up is alive meanwhile and exits
at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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


def probe(port: int, path: str = "/readyz") -> tuple[int, dict[str, object]]:
    """(status, JSON answer) of a probe; (0, {}) while nothing listens."""
    try:
        response = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
    except httpx.TransportError:
        return 0, {}
    return response.status_code, response.json()


def stop(worker: subprocess.Popen[str]) -> tuple[str, str, float]:
    """SIGTERM: (stdout, stderr, seconds from the signal to the exit)."""
    worker.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    out, err = worker.communicate(timeout=60)
    return out, err, time.monotonic() - signalled


def committed(url: str) -> int:
    return sum(p for (p,) in rows(url, "SELECT next_offset FROM source_positions WHERE pipeline = 'reliability'"))


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_a_sigkilled_worker_and_a_hung_one_are_restarted_and_nothing_is_lost_or_duplicated(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path, client: str) -> None:
    # the topic exists, empty (the fixture made it): both workers join before the work comes
    upgrade(make_engine(postgres_url))
    port = free_port()
    # calls of ~0.4 s: the run lasts long enough for a kill, a restart and a hang in the middle of it
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "etl.cli", "run", PIPELINE, "--workers", "2", "--stop-when-idle", "5",
         "--metrics-port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.4), "ETL_STALL_S": "4",
             "ETL_KAFKA_CLIENT": client})
    try:
        wait_for(lambda: len(children(supervisor.pid)) == 2, 60, "two workers did not start")
        first = children(supervisor.pid)
        wait_for(lambda: probe(port)[0] == 200, 90, "the workers never became ready")
        tickets(kafka_bootstrap, topic)
        wait_for(lambda: committed(postgres_url) >= 300, 120, "no progress")
        ready = probe(port)[1]
        # both children's series, once each has committed something (the second may still be joining)
        wait_for(lambda: 'etl_results_written_total{pipeline="reliability",worker="1"}' in httpx.get(
            f"http://127.0.0.1:{port}/metrics", timeout=10).text, 60, "the second worker's metrics never came")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        victim = min(first)
        os.kill(victim, signal.SIGKILL)  # mid-run: its in-flight calls are lost with it
        wait_for(lambda: len(children(supervisor.pid) - first) == 1, 60, "the killed worker was not restarted")
        second = children(supervisor.pid)
        done = committed(postgres_url)
        wait_for(lambda: committed(postgres_url) >= done + 100 or committed(postgres_url) == N, 120, "no progress")
        os.kill(max(first), signal.SIGSTOP)  # hung: alive, silent, holding its partitions
        wait_for(lambda: len(children(supervisor.pid) - second) == 1, 60, "the hung worker was not replaced")
        out, err = supervisor.communicate(timeout=300)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == 0, err[-3000:]
    assert ready["ok"] and ready["workers_reporting"] == 2, ready
    assert 'worker="0"' in metrics and 'worker="1"' in metrics, metrics[:2000]  # both children's series
    assert "2 restarts" in out and "worker_stuck" in err, (out, err[-3000:])
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == end_offsets(
        kafka_bootstrap, topic)
    assert rows(postgres_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results") == [(N, N)]
    calls = len((tmp_path / "calls.log").read_text().splitlines())
    assert UNIQUE <= calls <= UNIQUE + 2 * IN_FLIGHT, calls  # one per content, plus what the kills lost
    print(f"\nworkers figures: messages={N} unique={UNIQUE} calls={calls} (lost with the kills: {calls - UNIQUE})")


@pytest.mark.parametrize("workers", [1, 2])
def test_the_drain_deadline_exits_a_stuck_worker_and_a_restart_resumes_exactly(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path, workers: int) -> None:
    tickets(kafka_bootstrap, topic)
    upgrade(make_engine(postgres_url))
    env = environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.05)
    # calls of about 10 s: when the signal comes, 32 are in flight and cannot all finish in 2 s
    worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE,
                               *(["--workers", str(workers)] if workers > 1 else [])], cwd=ROOT, text=True,
                              env={**env, "ETL_DRAIN_TIMEOUT_S": "2", "RELIABILITY_LATENCY_S": "10"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: committed(postgres_url) > 0, 120, "no progress")
        out, err, took = stop(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 3, (worker.returncode, err[-3000:])  # the deadline's exit, the supervisor's too
    assert took < 2 + 5, took
    if workers == 1:  # (a supervisor's children print to /dev/null)
        assert "drain deadline (2 s) passed" in out + err
    positions = committed(postgres_url)
    assert 0 < positions < N and rows(postgres_url, "SELECT count(*) FROM stage_results")[0][0] >= positions
    resumed = subprocess.run([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--stop-when-idle", "4"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(postgres_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results") == [(N, N)]
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == end_offsets(
        kafka_bootstrap, topic)
    calls = len((tmp_path / "calls.log").read_text().splitlines())
    assert calls <= UNIQUE + workers * IN_FLIGHT, calls  # each worker's unfinished calls are paid again, nothing else


#: SIGTERMs in CI; the figure in issue 29's note ran ETL_DRAIN_SIGTERMS=50.
SIGTERMS = int(os.environ.get("ETL_DRAIN_SIGTERMS", "5"))


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_sigterm_drains_mid_run_and_nothing_is_lost_or_paid_twice(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        client: str) -> None:
    """A cold run stopped by SIGTERM again and again, each time while calls are in flight: every
    drain finishes its calls and commits them (exit 0), so after the last restart every message
    has one result, the positions are the end offsets, and the model was asked once per content."""
    # every content unique, enough that each SIGTERM (after 10 new calls, plus the window it
    # drains and what it read ahead) still finds work
    n = SIGTERMS * 80 + 500
    produce(kafka_bootstrap, topic, [
        (None, json.dumps({"id": f"d{i}", "tenant": "acme", "text": f"ticket {i}"}).encode()) for i in range(n)])
    upgrade(make_engine(postgres_url))
    env = {**environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.05), "ETL_KAFKA_CLIENT": client}
    calls_log = tmp_path / "calls.log"

    def paid() -> int:
        return len(calls_log.read_text().splitlines()) if calls_log.exists() else 0

    drains = []
    for number in range(SIGTERMS):
        worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            before = paid()
            wait_for(lambda: paid() >= before + 10, 120, f"no calls after SIGTERM {number}")  # noqa: B023
            _, err, took = stop(worker)  # mid-run: calls in flight, more read ahead
            drains.append(took)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert worker.returncode == 0, (number, worker.returncode, err[-3000:])  # drained, not the deadline
    assert committed(postgres_url) < n  # every SIGTERM came mid-run
    last = subprocess.run([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--stop-when-idle", "4"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr[-3000:]
    results = rows(postgres_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results")[0]
    calls = paid()
    with capsys.disabled():  # the figure belongs in CI's output
        print(f"\ndrain figures ({client}): SIGTERMs={len(drains)} messages={n} results={results[0]} lost={n - results[1]} "
              f"duplicated={results[0] - results[1]} calls={calls} paid_twice={calls - n} "
              f"drain_s_max={max(drains):.2f}")
    assert results == (n, n)
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == end_offsets(
        kafka_bootstrap, topic)
    assert calls == n  # a drain finishes what it asked: nothing is asked twice


def test_readyz_is_false_while_postgres_is_down_and_true_after(
        kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path) -> None:
    upgrade(make_engine(postgres_url))
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--metrics-port", str(port)],
                              env=environment(kafka_bootstrap, topic, postgres_url, tmp_path, 0.05), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: probe(port)[0] == 200, 90, "the worker never became ready")
        subprocess.run([SERVICES, "stop-postgres"], check=True, capture_output=True, timeout=120)
        try:
            status, body = probe(port)
            assert status == 503 and body["store"]["ok"] is False, body  # type: ignore[index]
            assert probe(port, "/healthz")[0] == 200  # alive: waiting out the database is not a reason to restart
        finally:
            subprocess.run([SERVICES, "start-postgres"], check=True, capture_output=True, timeout=180)
        wait_for(lambda: probe(port)[0] == 200, 60, "not ready again after PostgreSQL came back")
        tickets(kafka_bootstrap, topic)  # and it still works
        wait_for(lambda: rows(postgres_url, "SELECT count(*) FROM stage_results")[0][0] == N, 120, "not processed")
        out, err, _ = stop(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, err[-3000:]


def test_a_worker_stopped_while_waiting_for_its_store_at_start_up_is_alive_meanwhile_and_exits_at_once(
        kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    port, nothing_there = free_port(), free_port()
    unreachable = f"postgresql+psycopg://etl:etl@127.0.0.1:{nothing_there}/etl"
    worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--metrics-port", str(port)],
                              env={**environment(kafka_bootstrap, topic, unreachable, tmp_path, 0.05),
                                   "ETL_STALL_S": "2", "ETL_STORE_RETRY_S": "300"},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: probe(port, "/healthz")[0] == 200, 60, "no probes")
        time.sleep(4)  # twice ETL_STALL_S, waiting for the store: starting, not stuck
        assert probe(port, "/healthz")[0] == 200
        assert probe(port)[0] == 503
        out, err, took = stop(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, (worker.returncode, err[-3000:])  # nothing read: a clean stop
    assert took < 10, took  # not the store's 300 s, nor the drain's 30
    assert "stopped_during_start_up" in err, err[-3000:]
