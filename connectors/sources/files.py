"""Finite sources on a laptop: a JSONL file, a directory of text files, an in-memory list.

They are re-read from the start on every run: the store turns already-processed messages into
no-ops, so a re-run costs no LLM call and writes no row, and lines appended since are processed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from connectors.sources.base import Message, Source, SourceUnavailable


class _IteratorSource(Source):
    """Serves ``poll`` from an iterator of messages made lazily by ``_messages``."""

    def __init__(self) -> None:
        self._it: Iterator[Message] | None = None

    def _messages(self) -> Iterator[Message]:
        raise NotImplementedError

    def poll(self, max_records: int, timeout_s: float) -> list[Message] | None:
        if max_records == 0:
            return []
        if self._it is None:
            self._it = self._messages()
        batch: list[Message] = []
        for message in self._it:
            batch.append(message)
            if len(batch) >= max_records:
                break
        if not batch:
            return None
        return batch


class JsonlSource(_IteratorSource):
    """One JSON object per line. Position: (path, 0, line number counted from 0).

    Blank lines are skipped; a line that is not valid JSON still becomes a message, which the decoder
    turns into a dead letter with its original bytes.
    """

    value_format = "json"

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.name = str(path)

    def open(self, ledger: Any = None) -> None:
        if not self.path.is_file():
            raise SourceUnavailable(f"input file {self.path} does not exist or is not a file")
        try:
            with self.path.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise SourceUnavailable(f"cannot read input file {self.path}: {exc.strerror}") from exc

    def _messages(self) -> Iterator[Message]:
        with self.path.open("rb") as f:
            for number, line in enumerate(f):
                if line.strip():
                    yield Message(value=line.rstrip(b"\r\n"), stream=self.name, offset=number)


class DirectorySource(_IteratorSource):
    """Every file under ``path`` matching ``pattern``, in sorted order; the document key is the
    file's path relative to the directory."""

    value_format = "text"

    def __init__(self, path: str | Path, pattern: str = "**/*.txt") -> None:
        super().__init__()
        self.path = Path(path)
        self.pattern = pattern
        self.name = str(path)

    def open(self, ledger: Any = None) -> None:
        if not self.path.is_dir():
            raise SourceUnavailable(f"input directory {self.path} does not exist or is not a directory")

    def _messages(self) -> Iterator[Message]:
        return _directory(self.path, (p for p in self.path.glob(self.pattern) if p.is_file()), self.name)


def _directory(root: Path, files: Iterable[Path], stream: str) -> Iterator[Message]:
    """One message per file, in sorted order (the offset), keyed by its path relative to ``root``."""
    for number, file in enumerate(sorted(files)):
        yield Message(value=file.read_bytes(), key=file.relative_to(root).as_posix().encode(), stream=stream,
                      offset=number)


class ListSource(_IteratorSource):
    """Messages from memory: dicts (sent as JSON), str or bytes. For tests and notebooks."""

    def __init__(self, items: Iterable[dict[str, Any] | str | bytes], name: str = "list",
                 value_format: Literal["json", "text", "file"] = "json") -> None:
        super().__init__()
        self.items = list(items)
        self.name = name
        self.value_format = value_format

    def _messages(self) -> Iterator[Message]:
        for number, item in enumerate(self.items):
            if isinstance(item, dict):
                value = json.dumps(item).encode()
            elif isinstance(item, str):
                value = item.encode()
            else:
                value = item
            yield Message(value=value, stream=self.name, offset=number)


class FileSource(_IteratorSource):
    """Documents as files (PDF, HTML, text, Markdown), read by the decoder's parsers.

    ``path`` is a directory (every file under it matching ``pattern``, in sorted order; the key is
    the path relative to it) or a JSONL file of paths (``{"path": ..., "id": ..., "tenant": ...}``
    per line, ``id`` and ``tenant`` optional; relative paths are relative to the JSONL file). A
    listed file that cannot be read becomes a message without bytes, which the decoder turns into
    that line's dead letter. Position: (path, 0, file number).
    """

    value_format = "file"
    #: What a directory is read for by default.
    SUFFIXES = (".pdf", ".html", ".htm", ".txt", ".md", ".markdown")

    def __init__(self, path: str | Path, pattern: str | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.pattern = pattern
        self.name = str(path)

    def open(self, ledger: Any = None) -> None:
        if not self.path.exists():
            raise SourceUnavailable(f"input {self.path} does not exist")
        if not self.path.is_dir() and not self.path.is_file():
            raise SourceUnavailable(f"input {self.path} is neither a directory nor a JSONL file of paths")

    def _messages(self) -> Iterator[Message]:
        if self.path.is_dir():
            yield from _directory(self.path, (p for p in self.path.glob(self.pattern or "**/*") if p.is_file() and (
                self.pattern is not None or p.suffix.lower() in self.SUFFIXES)), self.name)
            return
        with self.path.open("rb") as listing:
            for number, line in enumerate(listing):
                if not line.strip():
                    continue
                yield self._listed(line, number)

    def _listed(self, line: bytes, number: int) -> Message:
        """One JSONL line's file; anything wrong with the line or the file is an empty message
        whose dead letter says why (headers carry the reason to the decoder)."""
        try:
            entry = json.loads(line)
            target = Path(entry["path"])
            file = target if target.is_absolute() else self.path.parent / target
            headers = tuple((name, str(entry[name]).encode()) for name in ("tenant",) if entry.get(name) is not None)
            key = str(entry.get("id") or entry["path"])
            return Message(value=file.read_bytes(), key=key.encode(), stream=self.name, offset=number,
                           headers=headers)
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            return Message(value=b"", key=None, stream=self.name, offset=number,
                           headers=(("unreadable", f"{type(exc).__name__}: {exc}".encode()[:300]),))


def source_for_path(path: str | Path) -> Source:
    """A JSONL source for a file, a directory source for a directory."""
    return DirectorySource(path) if Path(path).is_dir() else JsonlSource(path)
