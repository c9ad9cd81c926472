"""``etl prune`` through the CLI on a real store: it removes only what no live fingerprint or
stage can reach, call rows past their retention, and its dry run changes nothing."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from etl.cli import app
from tests.helpers import counts, rows

PIPELINE = """
from pydantic import BaseModel
from etl import Classify, Extract, Pipeline
from etl.testing import FakeLLM

class Fields(BaseModel):
    amount: int

pipeline = Pipeline({name!r}, {source!r}, [{stages}], llm=FakeLLM())
"""
ROUTE = "Classify(['a', 'b'], {instructions!r}, name='route')"
FIELDS = "Extract(Fields, 'Extract.', name='fields', table='prune_fields')"
TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "prune_fields")


def invoke(*args: str, url: str) -> object:
    return CliRunner().invoke(app, list(args), env={"ETL_DATABASE_URL": url})


def write(path: Path, name: str, source: Path, *stages: str) -> str:
    path.write_text(PIPELINE.format(name=name, source=str(source), stages=", ".join(stages)))
    return str(path)


def test_prune_removes_only_what_no_live_stage_uses(tmp_path: Path, store_url: str) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"id": "{i}", "text": "doc {i}"}}\n' for i in range(10)))
    half = tmp_path / "half.jsonl"
    half.write_text("".join(f'{{"id": "{i}", "text": "doc {i}"}}\n' for i in range(5)))
    v1 = write(tmp_path / "v1.py", "p", docs, ROUTE.format(instructions="Pick one."), FIELDS)
    assert invoke("run", v1, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    # Version 2: a new prompt for route, no fields stage; run over half of the documents. Before
    # it has run, nothing proves its stages are what runs use (another model? settings?): refused.
    v2 = write(tmp_path / "v2.py", "p", half, ROUTE.format(instructions="Pick one, carefully."))
    early = invoke("prune", v2, "--dry-run", url=store_url)
    assert early.exit_code == 1 and "p/default configuration/route: its newest answer is not at" in early.output  # type: ignore[attr-defined]
    assert invoke("run", v2, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    # Another pipeline in the same store, whose rows prune must not touch.
    other = write(tmp_path / "other.py", "q", docs, ROUTE.format(instructions="Choose."))
    assert invoke("run", other, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    engine = create_engine(store_url)
    with engine.begin() as conn:  # two of p's call rows are old
        conn.execute(text("UPDATE llm_calls SET created_at = :old WHERE id IN "
                          "(SELECT id FROM llm_calls WHERE pipeline = 'p' ORDER BY id LIMIT 2)"),
                     {"old": "2020-01-01 00:00:00+00:00"})
    engine.dispose()

    refused = invoke("prune", v2, "--dry-run", url=store_url)
    assert refused.exit_code == 1 and "also holds pipeline(s) q" in refused.output  # type: ignore[attr-defined]
    # v2 has no fields stage, but a worker may still run v1: its results go only when named.
    named = invoke("prune", v2, other, "--yes", url=store_url)
    assert named.exit_code == 1 and "p/fields: results of a stage the given files no longer have" in named.output  # type: ignore[attr-defined]

    before = counts(store_url, TABLES)
    dry = invoke("prune", v2, other, "--drop-stage", "fields", "--dry-run", "--retention-days", "30", url=store_url)
    assert dry.exit_code == 0, dry.output  # type: ignore[attr-defined]
    assert "dry run: nothing deleted" in dry.output  # type: ignore[attr-defined]
    assert "5 result(s) of live stages at an older fingerprint are kept" in dry.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES) == before

    # What no live stage uses: v1's route and fields entries (10 + 10); fields results of the 5
    # documents v2 did not process again (v2's own run deleted the other 5, but not their typed rows,
    # its pipeline no longer knowing the table); kept: v1's route results of those 5.
    assert rows(store_url, "SELECT count(*) FROM stage_results WHERE stage = 'fields'") == [(5,)]
    assert before["prune_fields"] == 10
    done = invoke("prune", v2, other, "--drop-stage", "fields", "--yes", "--retention-days", "30", url=store_url)
    assert done.exit_code == 0, done.output  # type: ignore[attr-defined]
    after = counts(store_url, TABLES)
    assert after["llm_cache"] == before["llm_cache"] - 20 == 15  # v2's 5 route entries and q's 10 stay
    assert after["prune_fields"] == 0 and after["stage_results"] == before["stage_results"] - 5
    assert after["llm_calls"] == before["llm_calls"] - 2 and after["documents"] == before["documents"]
    assert rows(store_url, "SELECT count(*) FROM stage_results WHERE pipeline = 'q'") == [(10,)]

    # What is live still serves: both pipelines re-run without a model call or a row.
    for path in (v2, other):
        again = invoke("run", path, url=store_url)
        assert again.exit_code == 0, again.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES) == after  # a model call would have added an llm_calls row
    # and the live cache entries answer new documents with the same texts: no model call.
    paid = "SELECT count(*) FROM llm_calls WHERE outcome <> 'cache_hit'"
    spent = rows(store_url, paid)
    copies = tmp_path / "copies.jsonl"
    copies.write_text("".join(f'{{"id": "copy-{i}", "text": "doc {i}"}}\n' for i in range(5)))
    v2_copies = write(tmp_path / "v2c.py", "p", copies, ROUTE.format(instructions="Pick one, carefully."))
    assert invoke("run", v2_copies, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    assert rows(store_url, paid) == spent
    assert rows(store_url, "SELECT count(*) FROM stage_results WHERE doc_key LIKE 'copy-%' AND cache_hit") == [(5,)]
    nothing = invoke("prune", v2, other, "--yes", "--retention-days", "30", url=store_url)
    assert "nothing to delete" in nothing.output  # type: ignore[attr-defined]


def test_prune_refuses_when_one_tenant_s_entries_are_not_at_its_live_fingerprint(tmp_path: Path,
                                                                                  store_url: str) -> None:
    """A tenant with its own model has entries at its fingerprint; prune is given the pipeline with
    another default model than its runs had: the other tenants' entries look dead, and are not."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"id": "{i}", "text": "doc {i}", "tenant": "{t}"}}\n'
                            for i in range(6) for t in ("acme", "beta")))
    body = ("from etl import Classify, Pipeline\nfrom etl.testing import FakeLLM\n"
            f"pipeline = Pipeline('p', {str(docs)!r}, [Classify(['a', 'b'], 'Pick one.', name='route')], "
            "llm=FakeLLM(model_id={model!r}), tenant_llms={{'acme': FakeLLM(model_id='acme-model')}})\n")
    ran, other = tmp_path / "ran.py", tmp_path / "other.py"
    ran.write_text(body.format(model="prod-model"))
    other.write_text(body.format(model="another-model"))
    assert invoke("run", str(ran), url=store_url).exit_code == 0  # type: ignore[attr-defined]
    before = counts(store_url, TABLES)
    refused = invoke("prune", str(other), "--yes", url=store_url)
    assert refused.exit_code == 1 and "p/default configuration/route: its newest answer is not at" in refused.output  # type: ignore[attr-defined]
    assert "acme/route" not in refused.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES) == before
    fine = invoke("prune", str(ran), "--yes", url=store_url)
    assert fine.exit_code == 0 and "nothing to delete" in fine.output, fine.output  # type: ignore[attr-defined]


def test_prune_refuses_a_stage_name_another_pipeline_proves_and_never_creates_a_store(tmp_path: Path,
                                                                                    store_url: str) -> None:
    """Pipelines p and q both have a stage named route (the cache has no pipeline column); p's
    prompt changes and has not run: q's entries at their live fingerprint prove nothing about p."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"id": "{i}", "text": "doc {i}"}}\n' for i in range(5)))
    p1 = write(tmp_path / "p1.py", "p", docs, ROUTE.format(instructions="Pick one."))
    q = write(tmp_path / "q.py", "q", docs, ROUTE.format(instructions="Choose."))
    for path in (p1, q):
        assert invoke("run", path, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    p2 = write(tmp_path / "p2.py", "p", docs, ROUTE.format(instructions="Pick one, carefully."))
    before = counts(store_url, TABLES[:4])
    refused = invoke("prune", p2, q, "--yes", url=store_url)
    assert refused.exit_code == 1 and "p/default configuration/route: its newest answer is not at" in refused.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES[:4]) == before
    missing = tmp_path / "typo.db"
    gone = CliRunner().invoke(app, ["prune", p2, "--dry-run", "--db", f"sqlite:///{missing}"])
    assert gone.exit_code == 1 and "no store at" in gone.output and not missing.exists()


def test_prune_trusts_what_ran_last_per_tenant_configuration(tmp_path: Path, store_url: str) -> None:
    """v1 ran, then v2 (a new prompt) for one tenant only: the old file is refused (v2's entries
    are live), the same pipeline twice is refused, and the tenant that sent nothing since does
    not block v2 (tenants without a configuration of their own share its fingerprint)."""
    both = tmp_path / "both.jsonl"
    both.write_text("".join(f'{{"id": "{i}", "text": "doc {i}", "tenant": "{t}"}}\n'
                            for i in range(5) for t in ("acme", "quiet")))
    acme = tmp_path / "acme.jsonl"
    acme.write_text("".join(f'{{"id": "n{i}", "text": "new doc {i}", "tenant": "acme"}}\n' for i in range(5)))
    v1 = write(tmp_path / "v1.py", "p", both, ROUTE.format(instructions="Pick one."))
    v2 = write(tmp_path / "v2.py", "p", acme, ROUTE.format(instructions="Pick one, carefully."))
    for path in (v1, v2):
        assert invoke("run", path, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    before = counts(store_url, TABLES[:4])
    old = invoke("prune", v1, "--yes", url=store_url)
    assert old.exit_code == 1 and "its newest answer is not at" in old.output, old.output  # type: ignore[attr-defined]
    twice = invoke("prune", v2, v1, "--yes", url=store_url)
    assert twice.exit_code == 1 and "p given twice" in twice.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES[:4]) == before
    # v2 runs now: v1's 10 entries go (the quiet tenant's 5 included: no file makes them any more)
    done = invoke("prune", v2, "--yes", url=store_url)
    assert done.exit_code == 0 and "deleted 10 row(s)" in done.output, done.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES[:4])["llm_cache"] == before["llm_cache"] - 10


def test_a_retired_pipeline_whose_tenants_were_purged_does_not_block_prune(tmp_path: Path, store_url: str) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"id": "{i}", "text": "doc {i}", "tenant": "gone"}}\n' for i in range(3)))
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(f'{{"id": "{i}", "text": "mine {i}", "tenant": "kept"}}\n' for i in range(3)))
    retired = write(tmp_path / "retired.py", "old", docs, ROUTE.format(instructions="Old."))
    live = write(tmp_path / "live.py", "p", mine, ROUTE.format(instructions="Pick one."))
    for path in (retired, live):
        assert invoke("run", path, url=store_url).exit_code == 0  # type: ignore[attr-defined]
    assert invoke("prune", live, "--dry-run", url=store_url).exit_code == 1  # type: ignore[attr-defined]
    assert invoke("tenant", "purge", "gone", "--yes", url=store_url).exit_code == 0  # type: ignore[attr-defined]
    left = invoke("prune", live, "--dry-run", url=store_url)  # only its positions are left
    assert left.exit_code == 0, left.output  # type: ignore[attr-defined]


def test_a_budget_s_fallback_answers_are_live(tmp_path: Path, store_url: str) -> None:
    """A tenant over its soft budget is answered by the fallback model, under its own fingerprint:
    those answers are what its runs use, so prune neither refuses for them nor deletes them."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"id": "{i}", "tenant": "acme", "text": "doc {i}"}}\n' for i in range(6)))
    path = tmp_path / "budget.py"
    path.write_text(PIPELINE.format(name="p", source=str(docs), stages=ROUTE.format(instructions="Pick one.")).replace(
        "llm=FakeLLM())", "llm=FakeLLM(),\n    budgets={'acme': Budget(10**9, soft=0, fallback=FakeLLM(model_id='small'))})"
    ).replace("from etl import", "from etl import Budget,"))
    assert invoke("run", str(path), url=store_url).exit_code == 0  # type: ignore[attr-defined]
    assert rows(store_url, "SELECT model, count(*) FROM llm_cache GROUP BY model") == [("small", 6)]
    before = counts(store_url, TABLES[:4])
    done = invoke("prune", str(path), "--yes", url=store_url)
    assert done.exit_code == 0, done.output  # type: ignore[attr-defined]
    assert counts(store_url, TABLES[:4]) == before
