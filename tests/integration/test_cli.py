"""The etl command: a run and its no-op re-run, status, migrations, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from etl.cli import app
from tests.helpers import counts

PIPELINE = '''
from etl import Classify, Pipeline
from etl.testing import FakeLLM
pipeline = Pipeline("cli", {source!r}, [Classify(["a", "b"], "Pick one.")], llm=FakeLLM())
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").write_text('{"id": "1", "text": "one"}\n{oops\n{"id": "2", "text": "two"}\n')
    (tmp_path / "p.py").write_text(PIPELINE.format(source=str(tmp_path / "in.jsonl")))
    return tmp_path


def invoke(*args: str, url: str) -> object:
    return CliRunner().invoke(app, list(args), env={"ETL_DATABASE_URL": url})


def test_run_then_rerun_is_a_no_op(project: Path, sqlite_url: str) -> None:
    first = invoke("run", str(project / "p.py"), url=sqlite_url)
    assert first.exit_code == 0, first.output  # type: ignore[attr-defined]
    assert "LLM calls" in first.output  # type: ignore[attr-defined]
    before = counts(sqlite_url)
    assert before["stage_results"] == 2 and before["dead_letters"] == 1
    second = invoke("run", str(project / "p.py"), url=sqlite_url)
    assert second.exit_code == 0
    assert "100.0%" in second.output  # type: ignore[attr-defined]
    assert counts(sqlite_url) == before
    status = invoke("status", url=sqlite_url)
    assert status.exit_code == 0 and "bad_input" in status.output and "classify" in status.output  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing.py", "does not exist"),
        ("no.such.module:pipeline", "cannot import module"),
        ("broken.py", "failed to load: NameError"),
        ("badlabel.py", "unknown label(s) ['c']"),
        ("nofile.py", "does not exist or is not a file"),
    ],
)
def test_user_errors_are_one_clear_line(project: Path, sqlite_url: str, target: str, message: str) -> None:
    (project / "broken.py").write_text("pipeline = Pipelin()\n")
    (project / "badlabel.py").write_text(
        "from etl import Classify, Extract, Pipeline, Receipt, label_in\n"
        "pipeline = Pipeline('x', 'in.jsonl', [Classify(['a', 'b'], name='k'), Extract(Receipt, when=label_in('k', 'c'))])\n"
    )
    (project / "nofile.py").write_text(PIPELINE.format(source=str(project / "nowhere.jsonl")))
    path = target if ":" in target else str(project / target)
    result = invoke("run", path, url=sqlite_url)
    assert result.exit_code != 0  # type: ignore[attr-defined]
    assert message in result.output, result.output  # type: ignore[attr-defined]
    assert "Traceback" not in result.output  # type: ignore[attr-defined]


def test_db_upgrade_and_status_on_empty_store(sqlite_url: str) -> None:
    assert "nothing processed yet" in invoke("status", url=sqlite_url).output  # type: ignore[attr-defined]
    result = invoke("db", "upgrade", url=sqlite_url)
    assert result.exit_code == 0 and "latest revision" in result.output  # type: ignore[attr-defined]
    assert counts(sqlite_url) == {t: 0 for t in counts(sqlite_url)}
    assert len(counts(sqlite_url)) == 6


def test_status_on_a_store_older_than_the_code_says_to_upgrade(sqlite_url: str) -> None:
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from connectors.store.sql import MIGRATIONS

    assert invoke("db", "upgrade", url=sqlite_url).exit_code == 0  # type: ignore[attr-defined]
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with create_engine(sqlite_url).begin() as conn:  # a store an older etl made: the newest columns missing
        config.attributes["connection"] = conn
        command.downgrade(config, "-1")
    result = invoke("status", url=sqlite_url)
    assert result.exit_code == 1 and "etl db upgrade" in result.output, result.output  # type: ignore[attr-defined]
    assert "Traceback" not in result.output  # type: ignore[attr-defined]
    assert invoke("db", "upgrade", url=sqlite_url).exit_code == 0  # type: ignore[attr-defined]
    assert "nothing processed yet" in invoke("status", url=sqlite_url).output  # type: ignore[attr-defined]


def test_dlq_list_and_replay_after_a_fix(tmp_path: Path, sqlite_url: str) -> None:
    """A prompt fix: the model answers nonsense for prompts without "JSON please"; after the fix
    the quarantined documents replay into results, once."""
    (tmp_path / "in.jsonl").write_text("".join(f'{{"id": "{i}", "text": "doc {i}"}}\n' for i in range(6)))
    pipeline = """
from etl import Classify, Pipeline
from etl.testing import FakeLLM
ok = lambda r: {{"label": "a"}} if "JSON please" in r.messages[0]["content"] else "no idea"
pipeline = Pipeline("dlq", {source!r}, [Classify(["a", "b"], {instructions!r})], llm=FakeLLM(answer=ok))
"""
    path = tmp_path / "dlq.py"
    path.write_text(pipeline.format(source=str(tmp_path / "in.jsonl"), instructions="Pick one."))
    assert invoke("run", str(path), url=sqlite_url).exit_code == 0
    listed = invoke("dlq", "list", "--reason", "schema_invalid", url=sqlite_url)
    assert "6 open dead letter(s) with reason schema_invalid" in listed.output  # type: ignore[attr-defined]
    path.write_text(pipeline.format(source=str(tmp_path / "in.jsonl"), instructions="Pick one. JSON please."))
    replayed = invoke("dlq", "replay", str(path), url=sqlite_url)
    assert replayed.exit_code == 0, replayed.output  # type: ignore[attr-defined]
    assert "results written          │ 6" in replayed.output  # type: ignore[attr-defined]
    assert "0 open dead letter(s)" in invoke("dlq", "list", url=sqlite_url).output  # type: ignore[attr-defined]
    before = counts(sqlite_url)
    again = invoke("dlq", "replay", str(path), url=sqlite_url)
    assert "documents read           │ 0" in again.output and counts(sqlite_url) == before  # type: ignore[attr-defined]
    status = invoke("status", url=sqlite_url).output  # type: ignore[attr-defined]
    assert "spent" in status and "saved" in status


def test_status_on_a_store_a_newer_etl_migrated_says_to_upgrade_etl(sqlite_url: str) -> None:
    from sqlalchemy import create_engine, text

    assert invoke("db", "upgrade", url=sqlite_url).exit_code == 0  # type: ignore[attr-defined]
    with create_engine(sqlite_url).begin() as conn:  # a revision this code has never heard of
        conn.execute(text("UPDATE alembic_version SET version_num = '0099_from_a_newer_etl'"))
    result = invoke("status", url=sqlite_url)
    assert result.exit_code == 1, result.output  # type: ignore[attr-defined]
    assert "newer than this etl" in result.output and "etl db upgrade" not in result.output, result.output  # type: ignore[attr-defined]
    upgraded = invoke("db", "upgrade", url=sqlite_url)  # and migrating it is refused with the same cause
    assert upgraded.exit_code == 1 and "newer than this etl" in upgraded.output, upgraded.output  # type: ignore[attr-defined]


def test_workers_are_for_a_consumer_group_and_a_count(project: Path, sqlite_url: str) -> None:
    for given, says in (("2", "a file is read by one worker"), ("0", "give a number from 1 to 256"),
                        ("many", "give a number from 1 to 256")):
        result = invoke("run", str(project / "p.py"), "--workers", given, url=sqlite_url)
        assert result.exit_code == 1 and says in result.output, (given, result.output)  # type: ignore[attr-defined]
        assert "Traceback" not in result.output  # type: ignore[attr-defined]
