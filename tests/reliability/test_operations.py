"""Operating a worker through the real CLI: metrics, a SIGTERM drain, a resumed run, a no-op replay
and status with lag, all against real Kafka and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from connectors.store import make_engine, upgrade
from tests.conftest import ROOT
from tests.helpers import counts, end_offsets, produce, rows

PIPELINE = str(Path(__file__).with_name("pipeline.py"))
N = 2000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etl(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "etl.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_drain_resume_replay_and_status(kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path) -> None:
    produce(kafka_bootstrap, topic, [
        (None, json.dumps({"id": f"o{i}", "tenant": "acme", "text": f"ticket {i % 1500}"}).encode()) for i in range(N)
    ])
    env = {**os.environ, "ETL_DATABASE_URL": postgres_url, "ETL_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "ETL_KAFKA_SESSION_TIMEOUT_MS": "6000", "ETL_MAX_IN_FLIGHT": "32", "RELIABILITY_TOPIC": topic,
           "RELIABILITY_CALL_LOG": str(tmp_path / "calls.log"), "RELIABILITY_LATENCY_S": "0.1",
           "ETL_LOG_JSON": "true", "ETL_LOG_LEVEL": "info"}
    upgrade(make_engine(postgres_url))
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE, "--metrics-port", str(port)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not rows(postgres_url, "SELECT 1 FROM source_positions LIMIT 1"):
            assert time.monotonic() < deadline and worker.poll() is None, worker.stderr.read() if worker.stderr else ""
            time.sleep(0.2)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, err
    assert 'etl_messages_total{pipeline="reliability",worker="0"}' in metrics
    assert "etl_llm_latency_seconds_bucket" in metrics and "etl_in_flight" in metrics
    assert any(json.loads(line).get("event") == "partition_assigned"
               for line in err.splitlines() if line.startswith("{"))  # structlog JSON, context bound

    # Drained: every committed position has its result; nothing committed is missing.
    drained = sum(p for (p,) in rows(postgres_url, "SELECT next_offset FROM source_positions"))
    assert 0 < drained < N
    assert counts(postgres_url)["stage_results"] >= drained

    resumed = etl("run", PIPELINE, "--stop-when-idle", "3", env=env)
    assert resumed.returncode == 0, resumed.stderr
    ends = end_offsets(kafka_bootstrap, topic)
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == ends
    assert rows(postgres_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results") == [(N, N)]
    calls_before = len((tmp_path / "calls.log").read_text().splitlines())
    assert calls_before == 1500  # one per unique text, across the drain and the resumed run

    before = counts(postgres_url)
    replayed = etl("replay", PIPELINE, env=env)
    assert replayed.returncode == 0, replayed.stderr
    assert "LLM calls" in replayed.stdout and f"documents read           │ {N}" in replayed.stdout
    assert len((tmp_path / "calls.log").read_text().splitlines()) == calls_before  # 0 LLM calls
    assert counts(postgres_url) == before  # 0 new rows

    status = etl("status", PIPELINE, env=env)
    assert status.returncode == 0, status.stderr
    assert "lag" in status.stdout and "end_offset" in status.stdout
    lags = [line for line in status.stdout.splitlines() if topic in line]
    assert len(lags) == 4 and all(line.rstrip(" │").split()[-1] == "0" for line in lags), status.stdout
