"""Metric math: accuracy, macro-F1, confusions, field matches."""

import pytest

from etl.quality.scoring import classification_scores, extraction_scores, normalize_value


def test_classification_scores() -> None:
    s = classification_scores(["a", "a", "b", "b"], ["a", "b", "b", None])
    assert s["accuracy"] == 0.5
    # a: p=1, r=.5 → f1=2/3; b: p=.5, r=.5 → f1=.5
    assert s["macro_f1"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert {(c["expected"], c["predicted"]) for c in s["confusions"]} == {("a", "b"), ("b", "<failed>")}


def test_extraction_scores_normalize_case_spacing_and_numbers() -> None:
    gold = [{"company": "ABC  Trading", "total": "9.00"}, {"company": "X", "total": "1.50"}]
    got = [{"company": "abc trading", "total": 9.0}, {"company": "Y", "total": 1.5}]
    s = extraction_scores(gold, got)
    assert s["accuracy"] == 0.5
    assert s["fields"]["company"] == {"exact": 0.0, "normalized": 0.5}
    assert s["fields"]["total"] == {"exact": 0.0, "normalized": 1.0}
    assert normalize_value("RM 9.00") == normalize_value(9) == 9.0

