"""A file's bytes → its text: PDF (pypdf), HTML (trafilatura), plain text and Markdown.

Pure of I/O (bytes in, text out), so a Kafka message that carries a file and a file on disk are
read the same way. The parser's name and version are part of what identifies the text
(``Parsed.parser``, hashed with it by the decoder): a parser upgrade that reads a file differently
is a visible new version of the document, never a silent change.

PDF pages are joined with a form feed (``\\f``), so a page is a span of the text: page *n* starts
after the *n*-th form feed (:func:`page_of`). Every way a file cannot become text is an
:class:`UnreadableFile` with a typed reason: its dead letter keeps the original bytes.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Literal

from etl.errors import BadInput

Format = Literal["pdf", "html", "text", "markdown"]
PAGE_BREAK = "\f"
_HTML = re.compile(rb"^\s*(<!doctype html|<html|<head|<body|<\?xml[^>]*>\s*<html)", re.IGNORECASE)
_SUFFIXES: dict[str, Format] = {".pdf": "pdf", ".html": "html", ".htm": "html", ".xhtml": "html", ".txt": "text",
                                ".text": "text", ".md": "markdown", ".markdown": "markdown"}


class UnreadableFile(BadInput):
    """A file that cannot become text: its dead letter says which way, with the original bytes."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Parsed:
    """A file's text and what read it."""

    text: str
    format: Format
    #: ``name version`` of the parser that made ``text`` (hashed with it).
    parser: str
    pages: int = 1


def sniff(data: bytes, name: str = "") -> Format:
    """The format by its first bytes (``%PDF-``, an HTML tag), else by the name's suffix, else text."""
    if data[:1024].lstrip().startswith(b"%PDF-"):
        return "pdf"
    if _HTML.match(data[:1024]):
        return "html"
    suffix = name[name.rfind("."):].lower() if "." in name else ""
    return _SUFFIXES.get(suffix, "text")


def parse(data: bytes, name: str = "", *, max_pages: int = 5000) -> Parsed:
    """The text of a file (format sniffed, see :func:`sniff`).

    Raises:
        UnreadableFile: reason ``encrypted`` (a password is needed), ``corrupt_file`` (not a
            readable PDF, not UTF-8 text), ``no_text`` (an image-only PDF, an empty page set, HTML
            without text) or ``too_large`` (more than ``max_pages`` pages).
    """
    kind = sniff(data, name)
    if kind == "pdf":
        return _pdf(data, max_pages)
    if kind == "html":
        return _html(data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"{kind} file is not valid UTF-8 at byte {exc.start}", "corrupt_file") from exc
    if not text.strip():
        raise UnreadableFile("empty file", "no_text")
    return Parsed(text, kind, "utf-8")


def page_of(text: str, offset: int) -> int:
    """The 1-based page of a character offset in a parsed PDF's text (1 for other formats)."""
    return text.count(PAGE_BREAK, 0, max(0, offset)) + 1


def _pdf(data: bytes, max_pages: int) -> Parsed:
    import pypdf  # noqa: PLC0415 - only where PDFs are read
    from pypdf.errors import PyPdfError  # noqa: PLC0415

    parser = f"pypdf {pypdf.__version__}"
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            # An owner password only (printing or copying restricted) opens with the empty user
            # password; anything else needs a password we do not have.
            try:
                opened = reader.decrypt("")
            except (PyPdfError, NotImplementedError) as exc:
                raise UnreadableFile(f"encrypted PDF: {exc}", "encrypted") from exc
            if not opened:
                raise UnreadableFile("encrypted PDF: a password is needed to read it", "encrypted")
        count = len(reader.pages)
        if count > max_pages:
            raise UnreadableFile(f"PDF has {count} pages, over the {max_pages}-page limit", "too_large")
        pages = [(page.extract_text() or "").replace(PAGE_BREAK, "\n") for page in reader.pages]
    except UnreadableFile:
        raise
    except Exception as exc:  # noqa: BLE001 - pypdf raises many kinds on broken files; none may stop a run
        raise UnreadableFile(f"corrupt PDF: {type(exc).__name__}: {str(exc)[:200]}", "corrupt_file") from exc
    if not any(page.strip() for page in pages):
        raise UnreadableFile(f"PDF of {count} page(s) has no text layer (scanned images need OCR first)", "no_text")
    return Parsed(PAGE_BREAK.join(pages), "pdf", parser, count)


def _html(data: bytes) -> Parsed:
    import trafilatura  # noqa: PLC0415 - only where HTML is read

    parser = f"trafilatura {trafilatura.__version__}"
    try:
        html = data.decode("utf-8", errors="replace")
        # The main text (boilerplate removed); a page too small for that heuristic keeps all its text.
        text = trafilatura.extract(html, output_format="txt", include_tables=True, favor_recall=True) \
            or trafilatura.html2txt(html)
    except Exception as exc:  # noqa: BLE001
        raise UnreadableFile(f"unreadable HTML: {type(exc).__name__}: {str(exc)[:200]}", "corrupt_file") from exc
    if not text or not text.strip():
        raise UnreadableFile("HTML page without text", "no_text")
    return Parsed(text, "html", parser)
