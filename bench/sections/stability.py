"""Stability of the local model: the demo's 200 banking77 messages, its intent stage asked K = 5
times (``etl stability``'s measure, the cache bypassed), and the same messages answered with one
llama.cpp thread and with all cores, as a stand-in for two CPUs (a different reduction order in
the matrix products can move a greedy decoder's argmax)."""

from __future__ import annotations

import asyncio
import os

from sqlalchemy import create_engine

from bench.common import Figure, ROOT, fresh_schema, log, summary
from connectors.sources.files import source_for_path
from etl.llm.local import LocalLLM
from etl.pipeline import load_pipeline
from etl.quality.golden import ask_afresh
from etl.quality.stability import answer_of, measure, source_documents
from etl.runtime.execute import ModelCalls, StagePlan

K = 5


def stability_figures() -> list[Figure]:
    pipeline = load_pipeline(str(ROOT / "examples" / "banking.py"))
    docs = source_documents(pipeline, source_for_path(ROOT / "examples" / "data" / "banking77.jsonl"), 200)
    engine = create_engine(fresh_schema())
    cores = os.cpu_count() or 1
    llm = LocalLLM(threads=cores)
    runs = asyncio.run(measure(engine, pipeline, llm, "intent", docs, K, concurrency=1))
    n = sum(r["documents"] for r in runs)
    unanimous = sum(r["unanimous"] * r["documents"] for r in runs) / n
    flips = sum(r["label_flip_rate"] * r["documents"] for r in runs) / n
    distinct = sum(r["distinct_answers"] * r["documents"] for r in runs) / n
    log(f"stability: {n} documents × {K}: unanimous {unanimous:.3f}, flip rate {flips:.3f}, distinct {distinct:.3f}")

    stage = next(s for s in pipeline.stages if s.name == "intent")
    calls = ModelCalls()

    async def labels(model: LocalLLM) -> list[str]:
        plan = StagePlan.of(stage, model)
        return [answer_of(stage, output, reason) for output, _, reason, *_ in
                [await ask_afresh(calls, plan, doc) for doc in docs]]

    many = asyncio.run(labels(llm))
    one = asyncio.run(labels(LocalLLM(threads=1)))
    differ = sum(a != b for a, b in zip(many, one, strict=True)) / len(docs)
    log(f"stability: labels differing between 1 and {cores} threads: {differ:.3f}")
    return [
        summary(f"stability: local SmolLM2, demo intent stage, documents answered one way over K = {K}", [unanimous],
                "measured (no goal)", note=f"{n} documents, {K} answers each at the stage's own settings (greedy), "
                f"cache bypassed; distinct answers per document {distinct:.3f}"),
        summary("stability: local SmolLM2, label flip rate (two answers to a document differ)", [flips],
                "measured (no goal)"),
        summary(f"stability: labels that differ between 1 and {cores} llama.cpp threads (share of documents)", [differ],
                "measured (no goal)", note="the same greedy model and prompts; a stand-in for two CPUs"),
    ]
