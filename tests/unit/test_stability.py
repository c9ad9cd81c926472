"""The figures of ``etl stability`` (etl.quality.stability.summarise) against a brute-force
reference: unanimity, distinct answers, Classify's label flip rate as the share of ordered pairs of
answers that differ, per-field agreement, stored answers reproduced; and the drop test."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etl.quality.compare import mcnemar
from etl.quality.stability import drop_z, summarise, wilson
from etl.stages import Classify, Extract
from pydantic import BaseModel

LABELS = ["a", "b", "c"]
CLASSIFY = Classify(LABELS, "Route.", name="route")


class Fields(BaseModel):
    x: int
    y: str


EXTRACT = Extract(Fields, "Extract.", name="fields")

label = st.one_of(st.sampled_from(LABELS).map(lambda v: ({"label": v, "confidence": 0.5}, None)),
                  st.just((None, "schema_invalid")))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6).flatmap(lambda k: st.lists(st.lists(label, min_size=k, max_size=k), min_size=1, max_size=8)))
def test_classify_figures_match_a_brute_force_count(answers: list[list[tuple[dict | None, str | None]]]) -> None:
    keys = [[o["label"] if o else f"<failed: {r}>" for o, r in doc] for doc in answers]
    labels = [[o["label"] for o, _ in doc if o] for doc in answers]  # the valid answers
    figures = summarise(CLASSIFY, answers)
    # one way: every sample a valid answer, all the same (failing every time is not stable)
    assert figures["unanimous"] == sum(len(set(d)) == 1 and not d[0].startswith("<failed") for d in keys) / len(keys)
    assert figures["distinct_answers"] == pytest.approx(sum(len(set(d)) for d in keys) / len(keys))
    # flips: ordered pairs of valid answers to one document that differ, over documents with two
    pairs = [sum(a != b for a, b in itertools.permutations(d, 2)) / (len(d) * (len(d) - 1)) for d in labels
             if len(d) > 1]
    if pairs:
        assert figures["label_flip_rate"] == pytest.approx(sum(pairs) / len(pairs))
        low, high = figures["details"]["label_flip_rate_ci"]
        assert 0 <= low <= figures["label_flip_rate"] + 1e-9 and figures["label_flip_rate"] - 1e-9 <= high <= 1
    else:
        assert figures["label_flip_rate"] is None
    assert figures["details"]["failed_samples"] == sum(o is None for d in answers for o, _ in d)
    # the samples' order does not matter
    assert summarise(CLASSIFY, [list(reversed(d)) for d in answers])["label_flip_rate"] == pytest.approx(
        figures["label_flip_rate"])


def test_confidence_is_not_part_of_a_label_and_a_stored_answer_is_compared_with_the_most_common() -> None:
    answers = [[({"label": "a", "confidence": c}, None) for c in (0.1, 0.9, 0.5)],
               [({"label": "a"}, None), ({"label": "b"}, None), ({"label": "b"}, None)]]
    figures = summarise(CLASSIFY, answers, [{"label": "a"}, {"label": "a"}])
    assert figures["unanimous"] == 0.5 and figures["distinct_answers"] == 1.5
    assert figures["label_flip_rate"] == pytest.approx((0 + 4 / 6) / 2)
    assert figures["reproduced"] == 0.5 and figures["details"]["stored_compared"] == 2
    assert summarise(CLASSIFY, answers, [None, None])["reproduced"] is None


def test_a_model_that_always_fails_is_not_stable() -> None:
    answers = [[(None, "schema_invalid")] * 4, [(None, "refusal"), ({"label": "a"}, None)] * 2]
    figures = summarise(CLASSIFY, answers)
    assert figures["unanimous"] == 0.0 and figures["details"]["failed_share"] == 6 / 8
    assert figures["label_flip_rate"] == 0.0  # the second's two valid answers agree; the first has none


def test_extract_fields_agree_separately() -> None:
    answers = [[({"x": 1, "y": "p"}, None), ({"x": 1, "y": "q"}, None), ({"x": 1, "y": "p"}, None), (None, "refusal")]]
    figures = summarise(EXTRACT, answers)
    assert figures["label_flip_rate"] is None and figures["unanimous"] == 0.0 and figures["distinct_answers"] == 3
    assert figures["details"]["fields"] == {"x": 1.0, "y": pytest.approx(2 / 3, abs=1e-6)}  # over the three valid answers


def test_a_drop_beyond_chance_and_the_wilson_interval() -> None:
    assert drop_z(0.9, 100, 0.9, 100) == 0.0 and drop_z(0.7, 100, 0.9, 100) == 0.0  # held, rose
    assert drop_z(0.9, 100, 0.85, 100) < 1.96 < drop_z(0.9, 100, 0.7, 100)
    low, high = wilson(70, 100)
    assert low == pytest.approx(0.604, abs=1e-3) and high == pytest.approx(0.781, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


@pytest.mark.parametrize(("a_only", "b_only"), [(0, 0), (25, 6), (6, 25), (3, 0), (10, 10), (40, 1)])
def test_mcnemar_is_the_exact_binomial_tail(a_only: int, b_only: int) -> None:
    a = {("t", str(i)): i < a_only for i in range(a_only + b_only)}
    b = {k: not v for k, v in a.items()}
    n, low = a_only + b_only, min(a_only, b_only)
    exact = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2**n)
    got = mcnemar(a, b)
    assert (got["a_only"], got["b_only"], got["examples"]) == (a_only, b_only, n)
    assert got["p"] == pytest.approx(exact, rel=1e-9)


def test_mcnemar_on_a_large_set_is_quick() -> None:
    a = {("t", str(i)): i % 3 == 0 for i in range(60_000)}
    b = {("t", str(i)): i % 3 == 1 for i in range(60_000)}
    assert mcnemar(a, b)["p"] == pytest.approx(1.0)  # 20,000 each way
