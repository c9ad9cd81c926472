"""Effectively-once under the faults a deployment sees, on real Kafka and real PostgreSQL.

20,000 messages (30% duplicate contents, 2 tenants, a few malformed) over 4 partitions; worker
processes (`etl run`, FakeLLM with lognormal latency) are SIGKILLed at random moments, one joins and
one leaves mid-run, the broker restarts once and PostgreSQL restarts once. At the end every message
has exactly one result or one dead letter, nothing is duplicated, the stored positions are the end
offsets, and the LLM calls are within unique contents + kills × max in-flight.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from connectors.store import make_engine, upgrade
from tests.conftest import ROOT
from tests.helpers import end_offsets, produce, rows

MESSAGES = 20_000
DUPLICATE_SHARE = 0.30
MALFORMED = 40
MAX_IN_FLIGHT = 32
MIN_KILLS = 20
SERVICES = str(ROOT / "services" / "services.sh")

pytestmark = pytest.mark.timeout(1200)


def corpus(seed: int = 20_000) -> tuple[list[tuple[bytes | None, bytes]], set[tuple[str, str]], set[int]]:
    """(messages, unique (tenant, text) pairs, indexes of malformed messages)."""
    rng = random.Random(seed)
    texts: list[str] = []
    malformed = set(rng.sample(range(MESSAGES), MALFORMED))
    out: list[tuple[bytes | None, bytes]] = []
    unique: set[tuple[str, str]] = set()
    for i in range(MESSAGES):
        if i in malformed:
            out.append((f"k{i}".encode(), rng.choice([b"{broken json", b"\xff\xfe", b'{"id": "no text"}'])))
            continue
        if texts and rng.random() < DUPLICATE_SHARE:
            text = rng.choice(texts)
        else:
            text = f"ticket {i}: {rng.choice(['refund', 'login', 'crash', 'invoice'])} #{rng.randint(0, 10**9)}"
            texts.append(text)
        tenant = ["acme", "globex"][rng.random() < 0.5]
        unique.add((tenant, text))
        out.append((f"k{i}".encode(), json.dumps({"id": f"m{i:05d}", "tenant": tenant, "text": text}).encode()))
    return out, unique, malformed


class Workers:
    """Worker processes running the real CLI, each with its own log file."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = 0

    def spawn(self) -> None:
        self.started += 1
        log = open(self.logs / f"worker-{self.started}.log", "wb")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "etl.cli", "run", str(Path(__file__).with_name("pipeline.py"))]
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))

    def kill_one(self, rng: random.Random) -> None:
        proc = rng.choice(self.procs)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.procs.remove(proc)

    def respawn_crashed(self) -> int:
        crashed = [p for p in self.procs if p.poll() is not None]
        for proc in crashed:
            self.procs.remove(proc)
            self.spawn()
        return len(crashed)

    def stop_one(self) -> int:
        proc = self.procs.pop(0)  # the oldest: surely past start-up and its signal handlers
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=120)

    def stop_all(self) -> list[int]:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        return [proc.wait(timeout=120) for proc in self.procs]


def print_worker_errors(logs: Path) -> None:
    """Shows what the workers said about the faults (store retries, revoked partitions)."""
    seen: dict[str, int] = {}
    for log in logs.glob("worker-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            for event in ("store_unavailable", "kafka_commit_failed", "poll_failed", "Traceback"):
                if event in line:
                    seen[event] = seen.get(event, 0) + 1
    print(f"\nworker log events: {seen}")


def stored_positions(url: str) -> dict[int, int]:
    return dict(rows(url, "SELECT partition, next_offset FROM source_positions WHERE pipeline = 'reliability'"))


def test_effectively_once_under_chaos(kafka_bootstrap: str, topic: str, postgres_url: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    messages, unique, malformed = corpus()
    produce(kafka_bootstrap, topic, messages)
    ends = end_offsets(kafka_bootstrap, topic)
    assert sum(ends.values()) == MESSAGES
    call_log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "ETL_DATABASE_URL": postgres_url,
        "ETL_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "ETL_KAFKA_SESSION_TIMEOUT_MS": "6000",
        "ETL_MAX_IN_FLIGHT": str(MAX_IN_FLIGHT),
        "ETL_CLAIM_LEASE_S": "3",
        "ETL_LOG_LEVEL": "warning",
        "RELIABILITY_TOPIC": topic,
        "RELIABILITY_CALL_LOG": str(call_log),
    }
    upgrade(make_engine(postgres_url))  # so progress can be read from the first moment
    rng = random.Random(7)
    workers = Workers(env, tmp_path)
    workers.spawn()
    workers.spawn()
    kills = crashes = 0
    events = {5: "join", 8: "restart-kafka", 12: "leave", 15: "restart-postgres"}
    done_events: list[str] = []
    started = time.monotonic()
    try:
        while kills < MIN_KILLS:
            # Spread the kills over the first 80% of the run: each waits for its share of progress,
            # then a random moment more, so every kill lands while work is in flight (the last fifth
            # is left for after it: faster workers once finished the last tenth within that moment).
            target = MESSAGES * (kills + 1) // (MIN_KILLS + 5)
            while sum(stored_positions(postgres_url).values()) < target:
                crashes += workers.respawn_crashed()
                time.sleep(0.1)
            time.sleep(rng.uniform(0, 1.0))
            workers.kill_one(rng)
            kills += 1
            workers.spawn()
            event = events.get(kills)
            if event == "join":
                workers.spawn()
            elif event == "leave":
                assert workers.stop_one() == 0  # a clean leave drains and exits 0
            elif event is not None:
                subprocess.run([SERVICES, event], check=True, capture_output=True, timeout=180)
            if event:
                done_events.append(event)
        chaos_s = time.monotonic() - started
        progress_at_chaos_end = sum(stored_positions(postgres_url).values())
        assert progress_at_chaos_end < MESSAGES, "the run ended before the chaos did"
        deadline = time.monotonic() + 600
        while stored_positions(postgres_url) != ends:
            assert time.monotonic() < deadline, f"not caught up: {stored_positions(postgres_url)} vs {ends}"
            crashes += workers.respawn_crashed()
            time.sleep(1)
        total_s = time.monotonic() - started
        exit_codes = workers.stop_all()
    finally:
        for proc in workers.procs:
            if proc.poll() is None:
                proc.kill()
    assert exit_codes == [0] * len(exit_codes)  # SIGTERM drains and exits cleanly

    url = postgres_url
    good = MESSAGES - MALFORMED
    with capsys.disabled():  # the figures belong in CI's output
        print_worker_errors(tmp_path)
    results = rows(url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results WHERE pipeline = 'reliability'")[0]
    documents = rows(url, "SELECT count(*) FROM documents WHERE pipeline = 'reliability'")[0][0]
    letters = rows(url, "SELECT partition, message_offset FROM dead_letters WHERE pipeline = 'reliability'")
    calls = len(call_log.read_text().splitlines())
    committed_calls = rows(url, "SELECT count(*) FROM llm_calls WHERE outcome = 'ok'")[0][0]
    cache_hits = rows(url, "SELECT count(*) FROM llm_calls WHERE outcome = 'cache_hit'")[0][0]
    bound = len(unique) + kills * MAX_IN_FLIGHT
    with capsys.disabled():
        print(
            f"\nchaos figures: messages={MESSAGES} malformed={MALFORMED} unique_contents={len(unique)} "
            f"kills={kills} crashes_respawned={crashes} events={done_events} workers_started={workers.started}\n"
            f"  results={results[0]} distinct_docs={results[1]} documents={documents} dead_letters={len(letters)} "
            f"(results + dead letters = {results[0] + len(letters)})\n"
            f"  llm_calls_made={calls} committed_ok_calls={committed_calls} cache_hit_rows={cache_hits} "
            f"bound(unique + kills x {MAX_IN_FLIGHT})={bound} wasted_by_crashes={calls - len(unique)}\n"
            f"  stored_positions={stored_positions(url)} end_offsets={ends}\n"
            f"  chaos_phase_s={chaos_s:.1f} processed_during_chaos={progress_at_chaos_end} total_s={total_s:.1f}"
        )
    assert done_events == ["join", "restart-kafka", "leave", "restart-postgres"]
    assert results == (good, good) and documents == good  # exactly one result per good message
    by_position = {p: {o for part, o in letters if part == p} for p in ends}
    expected = {p: set() for p in ends}  # type: dict[int, set[int]]
    for i in malformed:
        expected[i % 4].add(i // 4)  # produced round-robin: message i is offset i // 4 of partition i % 4
    assert by_position == expected  # exactly one dead letter per malformed message, none for good ones
    assert len(unique) <= calls <= bound
    assert committed_calls == len(unique)  # committed outputs: one per unique (tenant, content)
    assert stored_positions(url) == ends
