"""The ``long`` section: expense bundles of 40 SROIE receipts (gold fields known), as text and PDF.

The model is simulated and says so: it reads its chunk page by page and answers each receipt's
company, date and total with the gold value on ``ACCURACY`` of the fields, another receipt's value
on most of the rest, and an invented value on ``INVENTED`` of them (the same answer every time for
the same receipt and field). Its context is 4,096 tokens. What this measures is the chunk / merge /
ground machinery against the same receipts asked one by one, not a model's quality.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dedup import sha256_hex
from etl import Extract, FileSource, ListSource, Pipeline
from etl.llm.base import LLMRequest
from etl.runtime.wiring import run_pipeline
from etl.stages.chunking import Chunking
from etl.stages.merge import concat
from etl.testing import FakeLLM

from bench.common import summary

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "sroie" / "receipts.jsonl"
ACCURACY, INVENTED = 0.93, 0.02
BUNDLE = 40
FIELDS = ("company", "date", "total")


class Item(BaseModel):
    company: str | None
    date: str | None
    total: str | None


class Bundle(BaseModel):
    receipts: list[Item]


def receipts() -> list[dict[str, Any]]:
    path = SHARED if SHARED.exists() else ROOT / "examples" / "data" / "receipts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def simulated(gold_by_page: dict[str, dict[str, Any]]) -> Any:
    """The simulated extractor (see the module): answers per page of whatever it is given."""
    others = [g for g in gold_by_page.values()]

    def value(page: str, field: str) -> str | None:
        gold = gold_by_page[page]
        draw = int(sha256_hex(f"{gold['id']}:{field}")[:12], 16) / 16**12
        if draw < ACCURACY:
            return gold["gold"][field]
        if draw < 1 - INVENTED:
            return others[int(draw * 1e6) % len(others)]["gold"][field]
        return f"INVENTED {sha256_hex(gold['id'] + field)[:10].upper()}"

    def answer(request: LLMRequest) -> dict[str, Any]:
        text = request.messages[-1]["content"]
        pages = [page.strip("\n") for page in text.split("\f")]
        return {"receipts": [{field: value(page, field) for field in FIELDS} for page in pages if page in gold_by_page]}

    return answer


def single(gold_by_page: dict[str, dict[str, Any]]) -> Any:
    bundle = simulated(gold_by_page)
    return lambda request: bundle(request)["receipts"][0]


def f1(predicted: list[dict[str, Any]], gold: list[dict[str, Any]]) -> float:
    """Field F1 over (field, value) multisets of one bundle."""
    want = Counter((f, str(g[f])) for g in gold for f in FIELDS if g.get(f) is not None)
    got = Counter((f, str(p[f])) for p in predicted for f in FIELDS if p.get(f) is not None)
    tp = sum((want & got).values())
    precision, recall = tp / max(sum(got.values()), 1), tp / max(sum(want.values()), 1)
    return 0.0 if tp == 0 else 2 * precision * recall / (precision + recall)


def _llm(answer: Any) -> FakeLLM:
    llm = FakeLLM(answer)
    llm.context_tokens = 4096
    return llm


def _pipeline(source: Any, url: str) -> Pipeline:
    return Pipeline("long", source, [Extract(Bundle, "Extract every receipt: company, date, total.", name="bundle",
                                             chunking=Chunking(), merge={"receipts": concat(key=FIELDS)})], store=url)


def _rows(url: str, sql: str) -> list[Any]:
    from sqlalchemy import create_engine, text  # noqa: PLC0415

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)))
    finally:
        engine.dispose()


def _outputs(url: str) -> dict[str, list[dict[str, Any]]]:
    found = _rows(url, "SELECT doc_key, output FROM stage_results")
    return {key: (json.loads(out) if isinstance(out, str) else out)["receipts"] for key, out in found}


def text_figures(folder: Path) -> dict[str, float]:
    data = receipts()
    bundles = [data[i:i + BUNDLE] for i in range(0, len(data) - BUNDLE + 1, BUNDLE)]
    gold_by_page = {r["text"].strip("\n"): r for r in data}
    url = f"sqlite:///{folder / 'text.db'}"
    docs = [{"id": f"bundle-{n:02d}", "text": "\f".join(r["text"] for r in bundle)} for n, bundle in enumerate(bundles)]
    llm = _llm(simulated(gold_by_page))
    asyncio.run(run_pipeline(_pipeline(ListSource(docs), url), llm=llm))
    chunks = Counter(key for (key,) in _rows(url, "SELECT doc_key FROM stage_chunks"))
    merged = _outputs(url)
    # the same receipts one by one, through the same simulated model
    one = f"sqlite:///{folder / 'one.db'}"
    singles = [{"id": r["id"], "text": r["text"]} for bundle in bundles for r in bundle]
    asyncio.run(run_pipeline(Pipeline("one", ListSource(singles), [
        Extract(Item, "Extract the receipt: company, date, total.", name="item")], store=one),
        llm=_llm(single(gold_by_page))))
    by_id = {key: (json.loads(out) if isinstance(out, str) else out) for key, out in
             _rows(one, "SELECT doc_key, output FROM stage_results")}
    ratios = []
    for n, bundle in enumerate(bundles):
        gold = [r["gold"] for r in bundle]
        alone = f1([by_id[r["id"]] for r in bundle], gold)
        ratios.append(f1(merged[f"bundle-{n:02d}"], gold) / alone if alone else 1.0)
    spans = _rows(url, "SELECT doc_key, value, match FROM field_spans")
    # values that are this bundle's gold (the aligner must find them), and invented ones (it must not)
    golds = {f"bundle-{n:02d}": {str(r["gold"][f]) for r in bundle for f in FIELDS} for n, bundle in enumerate(bundles)}
    invented = [match for _, value, match in spans if str(value).startswith("INVENTED")]
    real = [match for key, value, match in spans if str(value) in golds[key]]
    elsewhere = [match for key, value, match in spans if str(value) not in golds[key] and not str(value).startswith("INVENTED")]
    # one receipt edited in each bundle: only its chunk (and a neighbour whose boundary moved) is asked
    edited = []
    for doc in docs:
        pages = doc["text"].split("\f")
        pages[17] += "\nTHANK YOU. PLEASE COME AGAIN"
        edited.append({**doc, "text": "\f".join(pages)})
        gold_by_page[pages[17].strip("\n")] = gold_by_page[doc["text"].split("\f")[17].strip("\n")]
    after = _llm(simulated(gold_by_page))
    asyncio.run(run_pipeline(_pipeline(ListSource(edited), url), llm=after))
    rerun = _llm(simulated(gold_by_page))
    asyncio.run(run_pipeline(_pipeline(ListSource(edited), url), llm=rerun))
    return {"f1_ratios": ratios, "elsewhere": len(elsewhere), "elsewhere_flagged": sum(m == "none" for m in elsewhere),
            "grounded": sum(m != "none" for m in real) / len(real), "flagged": sum(m == "none" for m in invented)
            / max(len(invented), 1), "invented": len(invented), "chunks": statistics.median(chunks.values()),
            "edit_calls_per_chunk": len(after.calls) / sum(chunks.values()), "edit_calls": len(after.calls),
            "bundles": len(bundles), "rerun_calls": len(rerun.calls), "first_calls": len(llm.calls)}


def pdf_throughput(folder: Path, runs: int) -> list[float]:
    """Pages per second, PDF to stored results with an instant model, ÷ pypdf's own text extraction
    of the same files, alternating in each run."""
    import pypdf  # noqa: PLC0415
    from fpdf import FPDF  # noqa: PLC0415

    data = receipts()
    pdfs = folder / "pdf"
    pdfs.mkdir(exist_ok=True)
    pages = 0
    for n in range(0, min(len(data), 200) - BUNDLE + 1, BUNDLE):
        document = FPDF()
        document.set_font("helvetica", size=7)
        document.set_auto_page_break(False)
        for r in data[n:n + BUNDLE]:
            document.add_page()
            document.multi_cell(0, 3, r["text"].encode("latin-1", "replace").decode("latin-1"))
        (pdfs / f"bundle-{n:03d}.pdf").write_bytes(bytes(document.output()))
        pages += BUNDLE
    ratios = []
    for run in range(runs):
        t0 = time.perf_counter()
        for path in sorted(pdfs.glob("*.pdf")):
            for page in pypdf.PdfReader(io.BytesIO(path.read_bytes())).pages:
                page.extract_text()
        raw = pages / (time.perf_counter() - t0)
        url = f"sqlite:///{folder / f'pdf-{run}.db'}"
        t0 = time.perf_counter()
        asyncio.run(run_pipeline(_pipeline(FileSource(pdfs), url), llm=_llm(lambda r: {"receipts": []})))
        ours = pages / (time.perf_counter() - t0)
        ratios.append(ours / raw)
    return ratios


def _eval_calibration(llm: Any, examples: list[dict[str, Any]], stage: Any) -> dict[str, Any]:
    """``etl eval``'s calibration of ``llm`` on ``examples`` (a fresh SQLite store)."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    from etl.quality.golden import evaluate, import_golden  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(f"sqlite:///{tmp}/golden.db")
        import_golden(engine, "long", stage.name, examples)
        (run,) = asyncio.run(evaluate(engine, Pipeline("long", ListSource([]), [stage]), llm))
        engine.dispose()
    return {**run["details"]["calibration"], "accuracy": run["accuracy"]}


#: How sure the simulated extractor says it is, per field: most answers sure, some not (Beta(4, 1)).
def _stated(key: str) -> float:
    return 0.05 + 0.95 * (int(sha256_hex(key)[:12], 16) / 16**12) ** 0.25


def calibration_figures(seeds: int, local_receipts: int) -> dict[str, Any]:
    """ECE of a simulated extractor that is right as often as it says (per field, with probability
    p, p ~ Beta(4, 1)), through the whole path: token log-probabilities → field confidence →
    ``etl eval`` on SROIE receipts as a golden set; and the local SmolLM2's own, on real receipts."""
    from etl import LocalLLM, Receipt  # noqa: PLC0415
    from etl.testing import value_logprobs  # noqa: PLC0415

    data = receipts()
    examples = [{"doc_key": r["id"], "tenant": "bench", "content": r["text"],
                 "expected": {f: r["gold"][f] for f in FIELDS}} for r in data]
    by_text = {r["text"]: r for r in data}
    stage = Extract(Item, "Extract the receipt's company, date and total.", name="receipt", grounding="off")
    eces = []
    for seed in range(seeds):
        def sure(request: LLMRequest, path: str, seed: int = seed) -> float:
            return _stated(f"{seed}:{by_text[request.messages[-1]['content']]['id']}:{path}")

        def answer(request: LLMRequest, seed: int = seed) -> dict[str, Any]:
            gold = by_text[request.messages[-1]["content"]]
            right = {f: int(sha256_hex(f"right:{seed}:{gold['id']}:{f}")[:12], 16) / 16**12
                     < _stated(f"{seed}:{gold['id']}:{f}") for f in FIELDS}
            return {f: gold["gold"][f] if right[f] else f"WRONG {f}" for f in FIELDS}

        eces.append(_eval_calibration(FakeLLM(answer, logprobs=value_logprobs(sure)), examples, stage))
    local = LocalLLM(n_ctx=2048)
    own = _eval_calibration(local, examples[:local_receipts],
                            Extract(Receipt, "Extract the receipt's key fields.", name="receipt", grounding="off"))
    return {"simulated": eces, "local": own, "values": eces[0]["pairs"]}


def figures(runs: int = 5) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        found = text_figures(Path(tmp))
        throughput = pdf_throughput(Path(tmp), runs)
    calibrated = calibration_figures(runs, 40)
    local = calibrated["local"]
    stated = (f"simulated extractor, {ACCURACY:.0%} of fields right, {INVENTED:.0%} invented; 4,096-token context; "
              f"{found['bundles']} bundles of {BUNDLE} SROIE receipts, median {found['chunks']:.0f} chunks each")
    return [
        summary("long documents: field F1, chunked ÷ the same receipts one by one",
                found["f1_ratios"], "≥ 0.97", met=lambda v: v >= 0.97,
                note=stated + "; median and min–max over the bundles of one run (the simulation is deterministic)"),
        summary("long documents: grounded share of extracted values that are the bundle's gold", [found["grounded"]],
                "≥ 0.99", "share", met=lambda v: v >= 0.99,
                note=f"of the wrong values taken from other receipts, {found['elsewhere_flagged']} of "
                     f"{found['elsewhere']} were not in the bundle's text and are flagged ungrounded too"),
        summary("long documents: injected invented values flagged ungrounded", [found["flagged"]], "1.00", "share",
                met=lambda v: v == 1.0, note=f"{found['invented']} invented values"),
        summary("long documents: model calls after editing one receipt ÷ chunks in the document",
                [found["edit_calls_per_chunk"]], "≤ 1/chunks + a neighbour", "ratio",
                met=lambda v, c=found["chunks"]: v <= 2 / c,
                note=f"{found['edit_calls']} calls for {found['bundles']} bundles each edited once"),
        summary("long documents: re-run of unchanged documents, model calls", [found["rerun_calls"]], "0", "calls",
                met=lambda v: v == 0),
        summary("long documents: pages per second, PDF to stored results (instant model) ÷ pypdf's text extraction",
                throughput, "≥ 0.8", met=lambda v: v >= 0.8,
                note="200 pages in 5 PDFs; the run parses, chunks, grounds and commits; SQLite"),
        summary("confidence: expected calibration error on the golden set", [c["ece"] for c in calibrated["simulated"]],
                "≤ 0.05", "ECE", met=lambda v: v <= 0.05,
                note=f"simulated extractor right as often as its token log-probabilities say (per field p ~ Beta(4, 1)), "
                     f"{calibrated['values']:,} values of {len(receipts())} SROIE receipts through etl eval, one seed "
                     "per run: this measures that the path keeps a calibrated model calibrated, not a model"),
        summary("confidence: expected calibration error, local SmolLM2-135M on SROIE receipts", [local["ece"]],
                "report", "ECE",
                note=f"{local['pairs']} values of 40 receipts, field accuracy "
                     f"{sum(b['accuracy'] * b['count'] for b in local['bins'] if b['count']) / max(local['pairs'], 1):.2f}, "
                     f"mean confidence {sum(b['confidence'] * b['count'] for b in local['bins'] if b['count']) / max(local['pairs'], 1):.2f}: "
                     "the constrained distribution's probability of what greedy decoding wrote; the 135M model is nearly always wrong and says so, which is calibrated but not useful"),
    ]


if __name__ == "__main__":
    for figure in figures(int(__import__("os").environ.get("BENCH_RUNS", "3"))):
        print(figure)
