"""Single-flight across two worker processes on PostgreSQL when a call outlives the lease, and when
one worker's clock is a minute ahead: every content is paid for once, a refused one included (the
waiting worker takes the holder's failure) (issue 11, case 1).

Both workers read the same file (a duplicated job, or two workers sharing keys), the second starting
once the first holds its claims, so every key is wanted by both; the model takes 5 s and a lease
lasts 2 s. Before leases were renewed and
timed by the database, the waiting worker took every expired claim and paid again; a worker whose
clock ran ahead took live claims at once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import rows

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = str(Path(__file__).with_name("lease_pipeline.py"))
#: A worker whose clock runs ahead: time.time() shifted before idem-etl is imported.
SKEWED = ("import sys, time; _real = time.time; time.time = lambda: _real() + {skew}; "
          "sys.argv = ['etl', *sys.argv[1:]]; from etl.cli.app import main; main()")


def corpus(n: int = 200, duplicates: float = 0.3, seed: int = 11) -> tuple[list[str], int]:
    """``n`` tickets over two tenants, ``duplicates`` of them repeating an earlier ticket's text and
    tenant; returns the JSONL lines and the number of unique (tenant, text) contents."""
    rng = random.Random(seed)
    docs: list[dict[str, str]] = []
    for i in range(n):
        if docs and rng.random() < duplicates:
            earlier = rng.choice(docs)
            docs.append({"id": f"d{i}", "tenant": earlier["tenant"], "text": earlier["text"]})
        else:
            marked = "refuse " if i % 10 == 0 else ""  # the model refuses these: waiters take the failure
            docs.append({"id": f"d{i}", "tenant": ["acme", "globex"][i % 2], "text": f"{marked}ticket {i}: {rng.random()}"})
    return [json.dumps(d) for d in docs], len({(d["tenant"], d["text"]) for d in docs})


@pytest.mark.parametrize("skew_s", [0, 60], ids=["same-clock", "one-clock-60s-ahead"])
def test_one_call_per_content_across_two_workers(skew_s: int, postgres_url: str, tmp_path: Path) -> None:
    lines, unique = corpus()
    data = tmp_path / "tickets.jsonl"
    data.write_text("\n".join(lines) + "\n")
    log = tmp_path / "calls.log"
    env = {**os.environ, "ETL_DATABASE_URL": postgres_url, "ETL_CLAIM_LEASE_S": "2", "ETL_MAX_IN_FLIGHT": "256",
           "ETL_LOG_LEVEL": "warning", "LEASE_INPUT": str(data), "LEASE_CALL_LOG": str(log), "LEASE_LATENCY_S": "5"}
    # The store is migrated once first, so the workers start their calls together.
    subprocess.run([sys.executable, "-m", "etl.cli", "db", "upgrade"], env=env, cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    first = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", PIPELINE], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The second worker (the skewed one) starts once the first holds claims: it finds them live.
    deadline = time.monotonic() + 60
    while rows(postgres_url, "SELECT count(*) FROM llm_claims") == [(0,)] and first.poll() is None:
        assert time.monotonic() < deadline, "the first worker claimed nothing in 60 s"
        time.sleep(0.05)
    second = subprocess.Popen([sys.executable, "-c", SKEWED.format(skew=skew_s), "run", PIPELINE], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = [first, second]
    outputs = [w.communicate(timeout=240)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    calls = len(log.read_text().splitlines())
    print(f"\nlease figures (skew {skew_s} s): documents=200 unique_contents={unique} model_calls={calls}")
    assert calls == unique, f"{calls} model calls for {unique} unique contents; workers said: {outputs}"
    refused = sum('"refuse ' in line for line in lines)
    results = rows(postgres_url, "SELECT count(*) FROM stage_results")[0][0]
    letters = rows(postgres_url, "SELECT count(*) FROM dead_letters WHERE status = 'open'")[0][0]
    assert (results, letters) == (200 - refused, refused)
