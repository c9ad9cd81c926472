"""`etl run --batch` SIGKILLed at chosen moments of the batch wire, on real PostgreSQL.

A 5,000-document backfill (30% duplicate contents, two stages: Classify, then Extract where its
label applies) against etl.testing.batch_server. The test server kills the worker process exactly where a
crash costs money or data: while a file is uploaded, after the provider made a batch and before the
worker heard its id, while a batch is polled, while results are downloaded, and just after they
are (the worker is committing). Some kills come at a random time instead. After each kill the run
starts again; at the end every document has one result per applicable stage, the server received
one request per unique cache key, and the recorded cost is what it billed at the batch price.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from etl.testing import BatchServer
from tests.helpers import rows

DOCUMENTS = 5_000
DUPLICATE_SHARE = 0.30
LABELS = ["billing", "technical", "account", "other"]
PRICES = (2.0, 8.0)  # USD per million tokens, synchronous; batches bill half
MOMENTS = ["upload", "create", "poll", "download", "downloaded", "random"]
MIN_KILLS = 24

pytestmark = pytest.mark.timeout(900)

PIPELINE_FILE = '''
import os
from pydantic import BaseModel
from etl import Classify, Extract, Pipeline, label_in
from etl.llm.anthropic import AnthropicLLM
from etl.llm.openai_compat import OpenAICompatibleLLM


class Ticket(BaseModel):
    summary: str
    amount: float


pipeline = Pipeline("backfill", os.environ["DOCS"], [
    Classify({labels!r}, "Route the ticket.", name="route"),
    Extract(Ticket, "Summarise it.", name="ticket", when=label_in("route", "billing", "account")),
], store=os.environ["STORE"], llm=AnthropicLLM("batch-model", base_url=os.environ["BATCH_URL"], api_key="test",
                                               price_per_mtok={prices!r}) if os.environ["WIRE"] == "anthropic"
  else OpenAICompatibleLLM(os.environ["BATCH_URL"], "batch-model", api_key="test", price_per_mtok={prices!r}))
'''


def documents(n: int) -> list[dict[str, str]]:
    unique = int(n * (1 - DUPLICATE_SHARE))
    rng = random.Random(5_000)
    contents = list(range(unique)) + [rng.randrange(unique) for _ in range(n - unique)]
    rng.shuffle(contents)
    return [{"id": f"d{i:05d}", "tenant": "acme", "text": f"ticket {k}: charged {k} times"}
            for i, k in enumerate(contents)]


class Killer:
    """Kills the current worker at the ``nth`` time the server reaches ``moment``."""

    def __init__(self) -> None:
        self.worker: subprocess.Popen[bytes] | None = None
        self.moment, self.nth, self.seen = "", 0, 0
        self.killed: list[str] = []
        self.rng = random.Random(20)
        self.lock = threading.Lock()

    def aim(self, worker: subprocess.Popen[bytes], moment: str, nth: int) -> None:
        with self.lock:
            self.worker, self.moment, self.nth, self.seen = worker, moment, nth, 0

    def __call__(self, moment: str) -> None:
        with self.lock:
            if self.worker is None or moment != self.moment:
                return
            self.seen += 1
            if self.seen != self.nth:
                return
            worker, self.worker = self.worker, None
        if moment == "downloaded":
            time.sleep(self.rng.uniform(0.0, 0.3))  # the worker validates and commits what it downloaded
        self.kill(worker, moment)

    def kill(self, worker: subprocess.Popen[bytes], moment: str) -> None:
        if worker.poll() is None:
            worker.send_signal(signal.SIGKILL)
            self.killed.append(moment)


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_killed_at_every_moment_of_the_wire_a_backfill_sends_each_request_once(
        tmp_path: Path, postgres_url: str, wire: str) -> None:
    items = documents(DOCUMENTS)
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in items))
    (tmp_path / "backfill.py").write_text(PIPELINE_FILE.format(labels=LABELS, prices=PRICES))
    rng = random.Random(13)
    killer = Killer()
    with BatchServer(polls=2, seed=3) as server:
        server.on_request = killer
        env = {**os.environ, "DOCS": str(source), "STORE": postgres_url, "WIRE": wire,
               "BATCH_URL": server.root if wire == "anthropic" else server.url,
               "ETL_BATCH_POLL_S": "0.05", "ETL_BATCH_WINDOW": "400"}  # many batches: many moments to die in
        command = [sys.executable, "-m", "etl.cli", "run", str(tmp_path / "backfill.py"), "--batch"]
        finished_early = 0
        for attempt in range(MIN_KILLS + 10):
            if len(killer.killed) >= MIN_KILLS:
                break
            moment = MOMENTS[attempt % len(MOMENTS)]
            worker = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            killer.aim(worker, moment, rng.randint(1, 3))
            if moment == "random":
                time.sleep(rng.uniform(1.5, 6.0))  # start-up takes ~1.5 s
                killer.kill(worker, "random")
            try:
                worker.wait(timeout=300)
            except subprocess.TimeoutExpired:
                worker.kill()
                pytest.fail(f"a batch run aimed at {moment!r} neither died nor finished in 300 s")
            finished_early += worker.returncode == 0
        kills = dict.fromkeys(MOMENTS, 0) | {m: killer.killed.count(m) for m in set(killer.killed)}
        server.on_request = None
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

        keys = rows(postgres_url, "SELECT count(DISTINCT cache_key) FROM llm_cache")[0][0]
        routed = dict(rows(postgres_url, "SELECT doc_key, output->>'label' FROM stage_results WHERE stage = 'route'"))
        tickets = rows(postgres_url, "SELECT doc_key FROM stage_results WHERE stage = 'ticket'")
        billed_in, billed_out = server.billed
        recorded = rows(postgres_url, "SELECT coalesce(sum(cost), 0) FROM llm_calls WHERE outcome <> 'cache_hit'")[0][0]
        made = len(server.batches if wire == "openai" else server.message_batches)
        print(f"\nbatch crash figures ({wire}): {len(killer.killed)} kills {kills}, {finished_early} runs finished before "
              f"their kill, {made} batches, {server.lines_received} lines received, {keys} unique "
              f"keys, ratio {server.lines_received / keys:.3f}, {len(tickets)} ticket results, recorded cost "
              f"${recorded:.6f} billed x batch price ${(billed_in * PRICES[0] + billed_out * PRICES[1]) / 2e6:.6f}")
        assert len(killer.killed) >= MIN_KILLS and all(kills[m] >= 2 for m in MOMENTS), kills
        assert sorted(routed) == sorted(d["id"] for d in items)  # one route result per document
        applies = sorted(k for k, label in routed.items() if label in ("billing", "account"))
        assert sorted(k for (k,) in tickets) == applies and applies  # one ticket result exactly where it applies
        assert rows(postgres_url, "SELECT count(*) FROM dead_letters") == [(0,)]
        unique_texts = len({d["text"] for d in items})
        unique_ticket_texts = len({d["text"] for d in items if d["id"] in set(applies)})
        assert keys == unique_texts + unique_ticket_texts
        assert server.lines_received == keys  # requests received ÷ unique keys = 1.00, whatever the kills hit
        assert recorded == pytest.approx((billed_in * PRICES[0] + billed_out * PRICES[1]) / 2 / 1e6, rel=1e-12)

        before = (server.http_requests, rows(postgres_url, "SELECT count(*) FROM llm_calls"),
                  rows(postgres_url, "SELECT count(*) FROM stage_results"))
        again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        after: Any = (server.http_requests, rows(postgres_url, "SELECT count(*) FROM llm_calls"),
                      rows(postgres_url, "SELECT count(*) FROM stage_results"))
        assert after == before  # a re-run after completion: 0 requests, 0 rows
