"""The router end to end on a real store: a student distilled from a Classify stage's own answers
answers what it is sure about; redelivery stays a no-op; the gate refuses what cannot be learned;
a student never answers for another fingerprint or tenant; shadow checks switch it off.

The LLM is simulated (``simulated_labeller``: 92% correct, the same answer for the same text) —
a remote provider's stand-in; the store is real (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import csv
import json
import random
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from etl import Classify, ListSource, Pipeline, Router
from etl.quality.golden import import_golden
from etl.quality.router import Distilled, distill
from etl.runtime.stats import RunStats
from etl.runtime.wiring import run_pipeline
from etl.settings import Settings
from etl.testing import FakeLLM, simulated_labeller
from tests.helpers import counts, rows

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
LABELS: list[str] = json.loads((DATA / "banking77_categories.json").read_text())
TRAIN = list(csv.DictReader((DATA / "banking77_train.csv").open(encoding="utf-8")))
TEST = list(csv.DictReader((DATA / "banking77_test.csv").open(encoding="utf-8")))
GOLD = {r["text"]: r["category"] for r in TRAIN + TEST}
STREAM = random.Random(1).sample(TRAIN, 3000)  # the LLM labels these; 400 of them are the golden set
GOLDEN = STREAM[:400]
NEW = TEST[:600]
TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "cache_texts", "router_checks", "students")


def teacher(**kwargs: Any) -> FakeLLM:
    return FakeLLM(simulated_labeller(GOLD, LABELS, **kwargs), tokens=(450, 8), price_per_mtok=(0.15, 0.60))


def pipeline(docs: list[dict[str, str]], llm: FakeLLM, prefix: str, *, tenant: str = "default",
             instructions: str = "Classify the banking customer's intent.", router: Router | None = None) -> Pipeline:
    source = ListSource([{"id": f"{prefix}{i}", "text": r["text"], "tenant": tenant} for i, r in enumerate(docs)])
    return Pipeline("b77", source=source, llm=llm,
                    stages=[Classify(LABELS, instructions, name="intent", router=router or Router())])


def run(p: Pipeline, url: str) -> RunStats:
    return asyncio.run(run_pipeline(p, Settings(), store_url=url))


def taught(url: str, llm: FakeLLM, *, golden: bool = True) -> Distilled:
    """Streams the training texts (the LLM labels them), imports the golden set, distills."""
    run(pipeline(STREAM, llm, "t"), url)
    engine = create_engine(url)
    if golden:
        import_golden(engine, "b77", "intent", [
            {"doc_key": f"g{i}", "content": r["text"], "expected": {"label": r["category"]}, "tenant": "default"}
            for i, r in enumerate(GOLDEN)])
    made = distill(engine, pipeline([], llm, "x"), llm, "intent")
    engine.dispose()
    assert len(made) == 1
    return made[0]


def test_a_student_answers_what_it_is_sure_about_and_redelivery_stays_a_no_op(store_url: str) -> None:
    llm = teacher()
    student = taught(store_url, llm)
    assert student.status == "active", student.reason
    assert student.row["holdout"] == "golden" and student.row["lower_bound"] >= student.row["target"] > 0.85
    assert counts(store_url, ("cache_texts",))["cache_texts"] == len({r["text"] for r in STREAM})

    before = len(llm.calls)
    stats = run(pipeline(NEW, llm, "n"), store_url)
    calls = len(llm.calls) - before
    answered = rows(store_url, "SELECT answered_by, cost, tokens_in, cache_hit FROM stage_results WHERE doc_key LIKE 'n%'")
    by_student = [r for r in answered if r[0] is not None]
    assert len(answered) == len(NEW)  # one result per document, whoever answered
    assert stats.student_answers == len(by_student) > len(NEW) // 2
    assert {r[0] for r in by_student} == {f"student:{student.student_id}"}
    assert all(r[1] == 0.0 and r[2] == 0 and not r[3] for r in by_student)
    assert calls == stats.llm_calls == len(NEW) - len(by_student)  # the rest, and the shadow checks
    checks = rows(store_url, "SELECT student_id, agree FROM router_checks")
    assert checks and all(sid == student.student_id for sid, _ in checks)
    assert len(checks) < calls

    # Redelivery of everything: no call, no row, whoever answered first.
    snapshot = counts(store_url, TABLES)
    before = len(llm.calls)
    again = run(pipeline(NEW, llm, "n"), store_url)
    assert len(llm.calls) == before and again.llm_calls == 0 and again.results_written == 0
    assert again.stored_hits == len(NEW) and again.student_answers == 0
    assert counts(store_url, TABLES) == snapshot

    # The producer sends the same texts again at later positions (newer versions of the same
    # content), and the student is off by then: the stored answers are kept, the student's too,
    # though they have no cache entry — no call, no rewrite.
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE students SET status = 'off'"))
    engine.dispose()
    answers = "SELECT doc_key, output, answered_by FROM stage_results WHERE doc_key LIKE 'n%' ORDER BY doc_key"
    stored = rows(store_url, answers)
    later = ListSource([{"id": "pad", "text": "hello", "tenant": "default"}]
                       + [{"id": f"n{i}", "text": r["text"], "tenant": "default"} for i, r in enumerate(NEW)])
    before = len(llm.calls)
    resent = run(Pipeline("b77", source=later, llm=llm, stages=[
        Classify(LABELS, "Classify the banking customer's intent.", name="intent", router=Router())]), store_url)
    assert len(llm.calls) - before == resent.llm_calls == 1  # "pad" only
    assert resent.results_written == 1 and rows(store_url, answers) == stored


def test_the_gate_refuses_a_student_whose_teacher_answers_at_random(sqlite_url: str) -> None:
    random_teacher = FakeLLM(simulated_labeller({}, LABELS), tokens=(450, 8))  # no gold: a label by hash
    made = taught(sqlite_url, random_teacher)
    assert made.status == "refused", made.reason
    assert rows(sqlite_url, "SELECT status FROM students") == [("refused",)]
    stats = run(pipeline(NEW, random_teacher, "n"), sqlite_url)
    assert stats.student_answers == 0 and stats.llm_calls == len(NEW)


def test_without_a_golden_set_the_gate_uses_held_out_llm_answers_and_refuses_an_unreachable_target(
        sqlite_url: str) -> None:
    llm = teacher()
    run(pipeline(STREAM, llm, "t"), sqlite_url)
    engine = create_engine(sqlite_url)
    # The LLM's own errors (8%, on random texts) cap what any student can agree with it on.
    (capped,) = distill(engine, pipeline([], llm, "x"), llm, "intent", target=0.99)
    (reachable,) = distill(engine, pipeline([], llm, "x"), llm, "intent", target=0.80)
    engine.dispose()
    assert capped.status == "refused" and "no threshold reaches 0.990" in capped.reason
    assert reachable.status == "active" and reachable.row["holdout"] == "llm", reachable.reason
    assert reachable.version == 2


def test_a_student_never_answers_for_another_fingerprint_or_tenant(sqlite_url: str) -> None:
    llm = teacher()
    assert taught(sqlite_url, llm).status == "active"
    other_prompt = run(pipeline(NEW, llm, "p", instructions="Which banking intent is this?"), sqlite_url)
    other_tenant = run(pipeline(NEW, llm, "q", tenant="globex"), sqlite_url)
    assert other_prompt.student_answers == other_tenant.student_answers == 0
    assert other_prompt.llm_calls == other_tenant.llm_calls == len(NEW)
    assert rows(sqlite_url, "SELECT count(*) FROM stage_results WHERE answered_by IS NOT NULL") == [(0,)]


def test_shadow_checks_switch_the_student_off_when_the_llm_changes(store_url: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    llm = teacher()
    student = taught(store_url, llm)
    assert student.status == "active", student.reason
    # The provider changes its model behind the same name: a different label mix (each label
    # answered as the next one), with the same fingerprint.
    shifted = {text: LABELS[(LABELS.index(label) + 1) % len(LABELS)] for text, label in GOLD.items()}
    llm.answer = simulated_labeller(shifted, LABELS)
    watch = Router(shadow_rate=0.25, window=100, min_checks=20)
    stats = run(pipeline(TEST[:1500], llm, "s", router=watch), store_url)
    status, reason = rows(store_url, f"SELECT status, reason FROM students WHERE id = {student.student_id}")[0]
    assert status == "off", reason
    alerts = rows(store_url, "SELECT metric, baseline, recent, score, threshold FROM drift_alerts")
    assert [a[0] for a in alerts] == ["router_agreement"]
    assert alerts[0][2] < alerts[0][1] and alerts[0][3] > alerts[0][4]  # score -log10 p over -log10(alpha / 2)
    # Bounded: the checks it takes to be sure (about min_checks) over the shadowed share of the
    # student's documents, with margin; everything after goes to the LLM again.
    with capsys.disabled():  # the figure belongs in CI's output
        checks = rows(store_url, f"SELECT count(*) FROM router_checks WHERE student_id = {student.student_id}")[0][0]
        print(f"\nshadow switch-off: {stats.student_answers} student answers, {checks} shadow checks before off")
    assert 0 < stats.student_answers <= 3 * watch.min_checks / watch.shadow_rate
    late = rows(store_url, "SELECT count(*) FROM stage_results WHERE doc_key IN ("
                + ",".join(f"'s{i}'" for i in range(1200, 1500)) + ") AND answered_by IS NOT NULL")
    assert late == [(0,)]
    # A restart does not bring it back: traffic stays with the LLM until a new student passes.
    restarted = run(pipeline(TEST[1500:1800], llm, "r", router=watch), store_url)
    assert restarted.student_answers == 0


def test_a_tenant_without_a_router_a_failed_shadow_check_and_an_unreadable_row(sqlite_url: str) -> None:
    """Three ways a student must step aside, or stand, without losing a document."""
    llm = teacher()
    student = taught(sqlite_url, llm)
    assert student.status == "active", student.reason

    # A tenant's override turns routing off: the router is not in the fingerprint, so the active
    # student has the same key, and still must not answer for that tenant (nor keep its texts).
    texts = counts(sqlite_url, ("cache_texts",))["cache_texts"]
    docs = [{"id": f"o{i}", "text": r["text"], "tenant": "default"} for i, r in enumerate(NEW[:100])]
    off = Pipeline("b77", source=ListSource(docs), llm=llm, tenant_overrides={"default": {"intent": {"router": None}}},
                   stages=[Classify(LABELS, "Classify the banking customer's intent.", name="intent", router=Router())])
    stats = run(off, sqlite_url)
    assert stats.student_answers == 0 and stats.llm_calls == 100
    assert counts(sqlite_url, ("cache_texts",))["cache_texts"] == texts

    # Every LLM call fails (an answer no schema accepts), the shadow checks' too: the student's
    # answers stand; only the documents it was not sure about end as dead letters.
    wrong = FakeLLM(lambda request: {"label": "no such intent"}, tokens=(450, 8))
    stats = run(pipeline(NEW[100:200], wrong, "f", router=Router(shadow_rate=1.0)), sqlite_url)
    assert stats.student_answers > 50 and stats.dead_letters == 100 - stats.student_answers
    assert stats.llm_calls == 2 * 100  # an ask and a repair each: every attempt is recorded and costed
    assert counts(sqlite_url, ("router_checks",))["router_checks"] == 0  # failed checks judge nothing
    assert rows(sqlite_url, "SELECT status FROM students") == [("active",)]

    # An active row anyone could have edited (no threshold; a spec that is not an object): skipped
    # with a log line; the documents go to the LLM.
    engine = create_engine(sqlite_url)
    for i, edit in enumerate(("UPDATE students SET threshold = NULL",
                              "UPDATE students SET threshold = 0.5, spec = '[1, 2]'")):
        with engine.begin() as conn:
            conn.execute(text(edit))
        stats = run(pipeline(NEW[200 + 50 * i:250 + 50 * i], llm, f"u{i}-"), sqlite_url)
        assert stats.student_answers == 0 and stats.dead_letters == 0 and stats.llm_calls == 50
    engine.dispose()
