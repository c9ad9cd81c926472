"""File sources: stable positions and keys, clear errors for unreadable input."""

from pathlib import Path

import pytest

from connectors.sources import DirectorySource, JsonlSource, ListSource
from connectors.sources.base import SourceUnavailable


def drain(source):  # type: ignore[no-untyped-def]
    source.open(lambda s, p: None)
    out = []
    while (batch := source.poll(2, 0)) is not None:
        out.extend(batch)
    return out


def test_jsonl_positions_are_line_numbers_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\r\nnot json\n')
    messages = drain(JsonlSource(f))
    assert [m.position.offset for m in messages] == [0, 2, 3]
    assert [m.value for m in messages] == [b'{"text": "a"}', b'{"text": "b"}', b"not json"]


def test_directory_keys_are_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "sub" / "a.txt").write_text("A")
    (tmp_path / "skip.bin").write_bytes(b"\0")
    messages = drain(DirectorySource(tmp_path))
    assert [(m.key, m.value) for m in messages] == [(b"b.txt", b"B"), (b"sub/a.txt", b"A")]


def test_missing_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable, match="does not exist"):
        JsonlSource(tmp_path / "nope.jsonl").open(lambda s, p: None)
    with pytest.raises(SourceUnavailable, match="not a directory"):
        DirectorySource(tmp_path / "nope").open(lambda s, p: None)


def test_a_full_runner_is_delivered_nothing_and_nothing_is_skipped() -> None:
    """``poll(0, ...)`` means the runner is full: no message may come back (it would not be
    dispatched, and the watermark could move past it)."""
    source = ListSource([{"text": "a"}, {"text": "b"}])
    source.open(lambda s, p: None)
    assert source.poll(0, 0) == []
    assert [m.position.offset for m in source.poll(5, 0) or []] == [0, 1]
    assert source.poll(5, 0) is None


def test_kafka_python_checks_record_crcs_in_c() -> None:
    """kafka-python falls back to a pure-Python CRC-32C (~1.7x slower consumption) without crc32c."""
    from kafka.record import util

    assert util.crc32c_c is not None, "crc32c is missing: install kafka-python[crc32c]"
