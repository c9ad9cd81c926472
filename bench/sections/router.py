"""The router: LLM calls per new document with a distilled student, and accuracy against gold."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Iterable

from sqlalchemy import create_engine, text

from etl import Classify, ListSource, Pipeline, Router
from etl.llm.base import LLMRequest
from etl.runtime.wiring import run_pipeline
from etl.settings import Settings
from etl.testing import FakeLLM, simulated_labeller

from bench.common import Figure, ROOT, fresh_schema, log, summary


def confusable_pairs(rows: list[dict[str, str]], share: float = 0.16) -> list[tuple[str, str]]:
    """banking77's most confused intents, from the data: a 3-fold cross-validated TF-IDF (word 1-2
    grams) + logistic regression's confusions, counted per unordered pair; the top pairs taken
    greedily (a label in one pair at most) until their labels hold ``share`` of the texts."""
    from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.model_selection import cross_val_predict  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    texts, gold = [r["text"] for r in rows], [r["category"] for r in rows]
    predicted = cross_val_predict(make_pipeline(TfidfVectorizer(ngram_range=(1, 2)), LogisticRegression(max_iter=1000)),
                                  texts, gold, cv=3)
    confused = Counter(tuple(sorted((g, p))) for g, p in zip(gold, predicted.tolist(), strict=True) if g != p)
    sizes, pairs, used = Counter(gold), [], set()
    for (a, b), _ in confused.most_common():
        if sum(sizes[label] for label in used) >= share * len(rows):
            break
        if a not in used and b not in used:
            pairs.append((a, b))
            used |= {a, b}
    return pairs


def router_figures(golden_n: int = 1000, accuracy: float = 0.92) -> list[Figure]:
    """The router on banking77: a Classify stage over the 10,003 training texts (every one an LLM
    call), a golden set of ``golden_n`` of them, ``distill``, then the 3,080 test texts as new
    documents; per error model of the simulated LLM (right on ``accuracy`` of the texts either way)."""
    import csv  # noqa: PLC0415
    import random  # noqa: PLC0415

    from etl.quality.golden import import_golden  # noqa: PLC0415
    from etl.quality.router import distill  # noqa: PLC0415

    data = ROOT / "examples/data"
    train, test = ([*csv.DictReader((data / f"banking77_{split}.csv").open())] for split in ("train", "test"))
    labels = json.loads((data / "banking77_categories.json").read_text())
    gold = {r["text"]: r["category"] for r in train + test}
    stage = Classify(labels, "Classify the banking customer's intent.", name="intent", router=Router())
    prices = (0.15, 0.60)
    tokens = (round((len(stage.system_prompt()) + statistics.mean(len(r["text"]) for r in train)) / 4), 8)
    per_call = (tokens[0] * prices[0] + tokens[1] * prices[1]) / 1e6
    pairs = confusable_pairs(train)
    log(f"router: confusable pairs {pairs}")

    def pipeline(llm: FakeLLM, split: str = "", rows: Iterable[dict[str, str]] = ()) -> Pipeline:
        docs = [{"id": f"{split}-{i}", "text": r["text"]} for i, r in enumerate(rows)]
        return Pipeline("banking77", ListSource(docs), [stage], llm=llm)

    out = []
    for errors, partners in (("random", None), ("confusable", {**dict(pairs), **{b: a for a, b in pairs}})):
        answer = simulated_labeller(gold, labels, accuracy, partners=partners)
        llm = FakeLLM(answer, tokens=tokens, price_per_mtok=prices)
        url = fresh_schema()
        engine = create_engine(url)
        asyncio.run(run_pipeline(pipeline(llm, "train", train), Settings(), store_url=url))
        golden = random.Random(0).sample(list(enumerate(train)), golden_n)
        import_golden(engine, "banking77", "intent", [
            {"doc_key": f"train-{i}", "tenant": "default", "content": r["text"], "expected": {"label": r["category"]}}
            for i, r in golden])
        t0 = time.perf_counter()
        (made,) = distill(engine, pipeline(llm), llm, "intent")
        distill_s, gate = time.perf_counter() - t0, made.row
        log(f"router {errors}: distill {made.status} in {distill_s:.1f} s: {made.reason}")
        before = len(llm.calls)
        stats = asyncio.run(run_pipeline(pipeline(llm, "test", test), Settings(), store_url=url))
        calls = len(llm.calls) - before
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT doc_key, output FROM stage_results WHERE doc_key LIKE 'test-%'"))
                       .all())
            spent = float(conn.execute(text("SELECT coalesce(sum(cost), 0) FROM llm_calls "
                                            "WHERE doc_key LIKE 'test-%' AND outcome <> 'cache_hit'")).scalar_one())
        engine.dispose()
        truth = [r["category"] for r in test]
        routed = [got[f"test-{i}"]["label"] for i in range(len(test))]
        alone = [answer(LLMRequest([{"role": "user", "content": r["text"]}], stage.llm_schema()))["label"]
                 for r in test]
        agree = lambda a, b: sum(x == y for x, y in zip(a, b, strict=True)) / len(test)  # noqa: E731
        routed_acc, alone_acc = agree(routed, truth), agree(alone, truth)
        log(f"router {errors}: test run {calls} LLM calls (stats {stats.llm_calls}), {stats.student_answers} student "
            f"answers; accuracy routed {routed_acc:.3f}, LLM alone {alone_acc:.3f}; cost ${spent:.6f} "
            f"(calls × price ${calls * per_call:.6f})")
        random_errors = partners is None
        note = f"the LLM is wrong on {1 - accuracy:.0%} of the texts: " + (
            "random texts, with a random other label. Classify over the 77 intents with Router() (shadow_rate "
            f"{stage.router.shadow_rate}); the {len(train):,} training texts answered by the LLM, {golden_n:,} of "
            "them (seed 0) imported as the golden set, `distill`, then the test texts as new documents. FakeLLM "
            f"priced as a hosted small model (gpt-4o-mini list price, ${prices[0]:.2f}/${prices[1]:.2f} per Mtok) at "
            f"{tokens[0]} tokens in (the system prompt with all 77 labels plus the average text, at ~4 characters "
            f"per token) and {tokens[1]} out. One run: the data and the simulated LLM are deterministic"
            if random_errors else
            "only texts of banking77's most confused intent pairs, which get their partner (so about half of "
            "those): " + ", ".join(f"{a} ↔ {b}" for a, b in pairs) + "; pairs from a 3-fold cross-validated "
            "TF-IDF + logistic regression on the training split, taken greedily until they hold ≥ 16% of the texts"
        ) + f". distill: {made.status}: {made.reason}; trained on {gate['trained_on']:,} LLM answers (fit " \
            f"{gate['train_s']} s)"
        out += [
            summary(f"router, {errors} LLM errors: LLM calls per new document ({len(test):,} banking77 test texts)",
                    [calls / len(test)], "≤ 0.25 at accuracy ≥ the LLM's alone" if random_errors else "",
                    "calls/doc", met=(lambda v, ok=routed_acc >= alone_acc: v <= 0.25 and ok) if random_errors else None,
                    note=note),
            summary("  accuracy vs gold, routed (the student where sure, else the LLM)", [routed_acc], "", "share"),
            summary("  accuracy vs gold, the LLM alone (its answers to every test text)", [alone_acc], "", "share"),
            summary("  routed results' agreement with the LLM's answers", [agree(routed, alone)], "", "share"),
            summary("  new documents answered by the student (shadow checks go to the LLM)",
                    [stats.student_answers / len(test)], "", "share"),
            summary("  cost per 1,000 new documents, routed", [spent / len(test) * 1000], "", "USD"),
            summary("  cost per 1,000 new documents, the LLM alone", [per_call * 1000], "", "USD"),
            summary("  distill: train, certify and store the student", [distill_s], "", "s"),
            summary("  gate: confidence threshold", [gate["threshold"] or math.nan], "", "confidence"),
            summary("  gate: golden accuracy's 95% lower bound at the threshold", [gate["lower_bound"]],
                    f"≥ {gate['target']:.3f} (the LLM's golden accuracy − 0.01)", "share",
                    met=lambda v, target=gate["target"]: v >= target),
            summary("  gate: golden coverage at the threshold", [gate["covered"] / gate["certified_on"]], "",
                    "share"),
        ]
    return out
