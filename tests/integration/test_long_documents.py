"""Long documents in real formats (issue 27): PDFs and HTML made here, read from files and from
Kafka, answered chunk by chunk with a cache per chunk, merged, grounded to character spans; files
that cannot be read are typed dead letters. SQLite and PostgreSQL alike; one Kafka end to end."""

from __future__ import annotations

import io
import json
import re
import tracemalloc
from pathlib import Path
from typing import Any

import pypdf
import pytest
from fpdf import FPDF
from pydantic import BaseModel

from etl import Extract, FileSource, KafkaSource, Pipeline, run_pipeline
from etl.errors import ConfigError
from etl.llm.base import LLMRequest
from etl.stages.chunking import Chunking
from etl.stages.merge import concat
from etl.testing import FakeLLM
from tests.conftest import EXAMPLES
from tests.helpers import counts, rows

RECEIPTS = [json.loads(line) for line in (EXAMPLES / "receipts.jsonl").read_text().splitlines()]
_DATE = re.compile(r"\b\d{1,2}[/.-]\d{1,2}[/.-]\d{2,4}\b")
_MONEY = re.compile(r"\b\d+\.\d{2}\b")


class Item(BaseModel):
    company: str
    date: str | None
    total: str | None


class Bundle(BaseModel):
    receipts: list[Item]


def latin(text: str) -> str:
    """What fpdf2's core fonts can write (the SROIE OCR text is nearly all Latin-1 already)."""
    return text.encode("latin-1", "replace").decode("latin-1")


def pdf(pages: list[str]) -> bytes:
    document = FPDF()
    document.set_font("helvetica", size=7)
    document.set_auto_page_break(False)  # one receipt a page, however long (the overflow stays in the text layer)
    for text in pages:
        document.add_page()
        if text:
            document.multi_cell(0, 3, latin(text))
    return bytes(document.output())


def reader(request: LLMRequest) -> dict[str, Any]:
    """A simulated extractor that reads what it is given: per page (or per receipt block) of its
    chunk, the first line as company, the first date and the last amount, as written there."""
    text = request.messages[-1]["content"]
    items = []
    for page in re.split(r"\f|\n\n+", text):
        lines = [line for line in page.splitlines() if line.strip()]
        if not lines:
            continue
        date, money = _DATE.search(page), _MONEY.findall(page)
        items.append({"company": lines[0].strip(), "date": date.group() if date else None,
                      "total": money[-1] if money else None})
    return {"receipts": items}


def ask(text: str) -> LLMRequest:
    return LLMRequest(messages=[{"role": "user", "content": text}], json_schema={}, max_tokens=1)


def pipeline(source: Any, url: str, **extract: Any) -> Pipeline:
    return Pipeline("long", source, [
        Extract(Bundle, "Extract every receipt: company, date, total.", name="bundle",
                chunking=Chunking(max_tokens=1500), merge={"receipts": concat(key=("company", "date", "total"))},
                **extract),
    ], store=url)


def pages(n: int = 40, start: int = 0) -> list[str]:
    return [receipt["text"] for receipt in RECEIPTS[start:start + n]]


def chunk_rows(url: str) -> list[tuple[Any, ...]]:
    return rows(url, "SELECT ordinal, cache_key, char_start, char_end, page_start, page_end, cache_hit "
                     "FROM stage_chunks ORDER BY ordinal")


async def test_a_40_page_pdf_is_answered_in_chunks_and_an_edited_page_repays_only_its_chunk(
        tmp_path: Path, store_url: str) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    original = pages()
    (folder / "bundle.pdf").write_bytes(pdf(original))
    llm = FakeLLM(reader)
    stats = await run_pipeline(pipeline(FileSource(folder), store_url), llm=llm)
    chunks = chunk_rows(store_url)
    assert stats.dead_letters == 0 and stats.results_written == 1
    assert len(chunks) > 3 and len(llm.calls) == stats.llm_calls == len(chunks)
    assert [c[4] for c in chunks][0] == 1 and chunks[-1][5] == 40  # pages 1 to 40, in order
    (output,) = [json.loads(o) if isinstance(o, str) else o for (o,) in rows(store_url, "SELECT output FROM stage_results")]
    distinct = {tuple(item.values()) for page in original for item in reader(ask(page))["receipts"]}
    assert len(output["receipts"]) == len(distinct) > 35  # every receipt, repeats merged away
    assert rows(store_url, "SELECT count(*) FROM bundle")[0][0] == 1

    # A re-run: nothing to call, nothing to write.
    before = counts(store_url, ("documents", "stage_results", "llm_cache", "llm_calls", "stage_chunks", "field_spans"))
    again = FakeLLM(reader)
    stats = await run_pipeline(pipeline(FileSource(folder), store_url), llm=again)
    assert len(again.calls) == stats.llm_calls == stats.results_written == 0
    assert counts(store_url, tuple(before)) == before

    # One page edited: its chunk (at most it and a neighbour whose boundary moved) is asked again.
    edited = list(original)
    edited[17] = edited[17].replace("TOTAL", "GRAND TOTAL", 1) + "\nTHANK YOU, COME AGAIN"
    (folder / "bundle.pdf").write_bytes(pdf(edited))
    after_edit = FakeLLM(reader)
    stats = await run_pipeline(pipeline(FileSource(folder), store_url), llm=after_edit)
    new_chunks = chunk_rows(store_url)
    print(f"\n40 pages: {len(chunks)} chunks; after editing page 18: {len(after_edit.calls)} model calls, "
          f"{sum(not c[6] for c in new_chunks)} chunks not from the cache")
    assert 1 <= len(after_edit.calls) <= 2 and stats.results_written == 1
    assert sum(not c[6] for c in new_chunks) == len(after_edit.calls)

    # A page deleted in the middle: the chunks after it move, keep their text, and their keys.
    deleted = edited[:25] + edited[26:]
    (folder / "bundle.pdf").write_bytes(pdf(deleted))
    after_delete = FakeLLM(reader)
    await run_pipeline(pipeline(FileSource(folder), store_url), llm=after_delete)
    print(f"after deleting page 26: {len(after_delete.calls)} model calls of {len(chunk_rows(store_url))} chunks")
    assert 1 <= len(after_delete.calls) <= 2
    (output,) = [json.loads(o) if isinstance(o, str) else o for (o,) in rows(store_url, "SELECT output FROM stage_results")]
    assert len(output["receipts"]) == len({tuple(item.values()) for page in deleted
                                           for item in reader(ask(page))["receipts"]})


async def test_spans_point_at_each_value_in_the_text(tmp_path: Path, store_url: str) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "bundle.pdf").write_bytes(pdf(pages(12)))
    await run_pipeline(pipeline(FileSource(folder), store_url), llm=FakeLLM(reader))
    text = pypdf_text(folder / "bundle.pdf")
    spans = rows(store_url, "SELECT path, value, char_start, char_end, page, match FROM field_spans ORDER BY path")
    assert len(spans) >= 12 * 2
    for path, value, start, end, page, match in spans:
        assert match == "exact", (path, value, match)
        assert text[start:end] == value  # the stored offsets are the document's own text's
        assert text.count("\f", 0, start) + 1 == page
    assert all(match != "none" for *_, match in spans)


def pypdf_text(path: Path) -> str:
    """The document's text as the decoder makes it (pages joined by form feeds)."""
    return "\f".join((page.extract_text() or "").replace("\f", "\n")
                     for page in pypdf.PdfReader(io.BytesIO(path.read_bytes())).pages)


async def test_an_invented_value_is_flagged_or_quarantined(tmp_path: Path, sqlite_url: str) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "bundle.pdf").write_bytes(pdf(pages(8)))

    def inventor(request: LLMRequest) -> dict[str, Any]:
        answer = reader(request)
        answer["receipts"][0]["company"] = "ACME HALLUCINATED TRADING"
        return answer

    await run_pipeline(pipeline(FileSource(folder), sqlite_url), llm=FakeLLM(inventor))
    flagged = rows(sqlite_url, "SELECT value FROM field_spans WHERE match = 'none'")
    assert ("ACME HALLUCINATED TRADING",) in flagged
    strict = f"sqlite:///{tmp_path / 'strict.db'}"
    stats = await run_pipeline(pipeline(FileSource(folder), strict, grounding="quarantine"), llm=FakeLLM(inventor))
    assert stats.dead_letters == 1
    assert rows(strict, "SELECT reason FROM dead_letters") == [("ungrounded",)]
    assert rows(strict, "SELECT count(*) FROM stage_results")[0][0] == 0
    assert rows(strict, "SELECT count(*) FROM llm_cache")[0][0] > 0  # the paid chunk answers are kept


async def test_files_that_cannot_become_text_are_typed_dead_letters(tmp_path: Path, store_url: str) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    good = pdf(pages(2))
    (folder / "a-good.pdf").write_bytes(good)
    (folder / "b-corrupt.pdf").write_bytes(good[: len(good) // 3])
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(good)))
    writer.encrypt("secret", algorithm="RC4-128")
    locked = io.BytesIO()
    writer.write(locked)
    (folder / "c-encrypted.pdf").write_bytes(locked.getvalue())
    scan = FPDF()
    scan.add_page()
    scan.rect(20, 20, 100, 140)  # a drawing, no text layer: what a scan without OCR looks like
    (folder / "d-image-only.pdf").write_bytes(bytes(scan.output()))
    (folder / "e-with-empty-page.pdf").write_bytes(pdf([pages(1)[0], "", pages(2)[1]]))
    (folder / "f-page.html").write_text("<html><head><title>Order</title></head><body><nav>Home | Shop</nav>"
                                        "<article><h1>Receipt</h1><p>SHOP SDN BHD</p><p>Date 12/03/2018</p>"
                                        "<p>TOTAL 12.50</p></article></body></html>")
    (folder / "g-notes.md").write_text("# SHOP SDN BHD\n\nDate 12/03/2018\n\nTOTAL 12.50\n")
    (folder / "h-latin1.txt").write_bytes("caf\xe9 12.50".encode("latin-1"))
    stats = await run_pipeline(pipeline(FileSource(folder), store_url), llm=FakeLLM(reader))
    # a file that is no document has no document key: its letter's detail names it
    letters = {detail.split(":")[0]: reason for detail, reason in rows(store_url, "SELECT detail, reason FROM dead_letters")}
    assert letters == {"b-corrupt.pdf": "corrupt_file", "c-encrypted.pdf": "encrypted",
                       "d-image-only.pdf": "no_text", "h-latin1.txt": "corrupt_file"}
    stored = {key for (key,) in rows(store_url, "SELECT doc_key FROM stage_results")}
    assert stored == {"a-good.pdf", "e-with-empty-page.pdf", "f-page.html", "g-notes.md"}
    assert stats.messages == 8 == stats.dead_letters + len(stored)
    payloads = rows(store_url, "SELECT payload FROM dead_letters WHERE reason = 'encrypted'")
    assert bytes(payloads[0][0]) == locked.getvalue()  # the original bytes, for a replay once it is fixed


async def test_a_jsonl_of_paths_with_tenants_and_a_missing_file(tmp_path: Path, sqlite_url: str) -> None:
    (tmp_path / "one.pdf").write_bytes(pdf(pages(3)))
    listing = tmp_path / "docs.jsonl"
    listing.write_text("\n".join(json.dumps(line) for line in (
        {"path": "one.pdf", "id": "acme-1", "tenant": "acme"},
        {"path": str(tmp_path / "one.pdf"), "id": "globex-1", "tenant": "globex"},
        {"path": "missing.pdf", "id": "gone"},
    )))
    stats = await run_pipeline(pipeline(FileSource(listing), sqlite_url), llm=FakeLLM(reader))
    assert sorted(rows(sqlite_url, "SELECT tenant, doc_key FROM stage_results")) == [("acme", "acme-1"),
                                                                                      ("globex", "globex-1")]
    assert rows(sqlite_url, "SELECT doc_key, reason FROM dead_letters") == [(None, "missing_file")]
    assert stats.dead_letters == 1


async def test_a_parser_upgrade_is_a_new_version(tmp_path: Path, sqlite_url: str) -> None:
    """The parser's name and version are hashed with the text: the same bytes read by another
    version of pypdf are a new version of the document (simulated by renaming the version)."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "one.pdf").write_bytes(pdf(pages(20)))
    await run_pipeline(pipeline(FileSource(folder), sqlite_url), llm=FakeLLM(reader))
    (first,) = rows(sqlite_url, "SELECT content_hash FROM documents")
    real = pypdf.__version__
    pypdf.__version__ = real + ".post1"
    try:
        llm = FakeLLM(reader)
        await run_pipeline(pipeline(FileSource(folder), sqlite_url), llm=llm)
    finally:
        pypdf.__version__ = real
    (second,) = rows(sqlite_url, "SELECT content_hash FROM documents")
    assert first != second
    assert len(llm.calls) == 0  # the same text: its chunks (keyed by their text) are in the cache


async def test_a_300_page_pdf(tmp_path: Path) -> None:
    """Memory grows with the document, not faster: the peak of traced allocations per character of
    text is no higher for 300 pages than for 100 (printed)."""
    per_char = {}
    for count in (100, 300):
        folder = tmp_path / f"in-{count}"
        folder.mkdir()
        (folder / "big.pdf").write_bytes(pdf([RECEIPTS[i % len(RECEIPTS)]["text"] + f"\nPAGE {i}"
                                              for i in range(count)]))
        url = f"sqlite:///{tmp_path / f'{count}.db'}"
        tracemalloc.start()
        try:
            stats = await run_pipeline(pipeline(FileSource(folder), url), llm=FakeLLM(reader))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        size = len(pypdf_text(folder / "big.pdf"))
        chunks = rows(url, "SELECT count(*) FROM stage_chunks")[0][0]
        per_char[count] = peak / size
        print(f"\n{count} pages, {size:,} characters: {chunks} chunks, peak traced memory {peak / 1e6:.1f} MB "
              f"({peak / size:.1f} bytes per character)")
        assert stats.dead_letters == 0 and chunks >= count // 8
    assert per_char[300] <= 1.2 * per_char[100]


def test_merge_rules_are_checked_when_the_stage_is_built() -> None:
    class Invoice(BaseModel):
        vendor: str
        total: float
        lines: list[str]

    with pytest.raises(ConfigError, match="not a list"):
        Extract(Invoice, chunking=Chunking(), merge={"vendor": "concat"})
    with pytest.raises(ConfigError, match="needs a number"):
        Extract(Invoice, chunking=Chunking(), merge={"vendor": "sum"})
    with pytest.raises(ConfigError, match="does not have"):
        Extract(Invoice, chunking=Chunking(), merge={"amount": "first"})
    with pytest.raises(ConfigError, match="give chunking"):
        Extract(Invoice, merge={"total": "sum"})
    stage = Extract(Invoice, chunking=Chunking(), merge={"total": "sum"})
    assert {name: rule.how for name, rule in stage.rules.items()} == {"vendor": "first", "total": "sum",
                                                                      "lines": "concat"}


async def test_long_pdfs_from_kafka_into_postgres(kafka_bootstrap: str, topic: str, postgres_url: str) -> None:
    """Kafka messages carrying PDF bytes (key: the document key; a tenant header): chunked, merged,
    grounded into PostgreSQL; a replay of the topic costs nothing."""
    documents = {f"bundle-{i}.pdf": pdf(pages(20, start=20 * i)) for i in range(3)}
    from kafka import KafkaProducer  # noqa: PLC0415

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", max_request_size=5_000_000)
    for number, (key, data) in enumerate(documents.items()):
        producer.send(topic, key=key.encode(), value=data, partition=number % 4, headers=[("tenant", b"acme")])
    producer.flush(timeout=60)
    producer.close()
    source = KafkaSource(topic, group=f"g-{topic}", bootstrap=kafka_bootstrap, value_format="file")
    llm = FakeLLM(reader)
    from etl.runtime.wiring import build_runner  # noqa: PLC0415

    runner = build_runner(pipeline(source, postgres_url), llm=llm, idle_stop_s=3)
    stats = await runner.run()
    assert stats.dead_letters == 0 and stats.results_written == 3
    assert rows(postgres_url, "SELECT count(DISTINCT doc_key) FROM field_spans WHERE tenant = 'acme'")[0][0] == 3
    assert rows(postgres_url, "SELECT count(*) FROM field_spans WHERE match = 'none'")[0][0] == 0
    calls = len(llm.calls)
    assert calls == rows(postgres_url, "SELECT count(*) FROM stage_chunks")[0][0]
    replay = FakeLLM(reader)
    replayer = build_runner(pipeline(KafkaSource(topic, bootstrap=kafka_bootstrap, replay_from="start",
                                                 value_format="file"), postgres_url), llm=replay)
    stats = await replayer.run()
    assert len(replay.calls) == stats.results_written == 0 and stats.messages == 3
