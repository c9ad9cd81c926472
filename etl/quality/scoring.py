"""Metric math, pure: accuracy, macro-F1, confusion pairs, field matches. No I/O."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any


def classification_scores(expected: Sequence[str], predicted: Sequence[str | None]) -> dict[str, Any]:
    """Accuracy, macro-F1 over the expected labels, and the most frequent confusions.

    A missing prediction (the model failed) counts as wrong for its expected label.
    """
    pairs = list(zip(expected, predicted, strict=True))
    correct = sum(e == p for e, p in pairs)
    labels = sorted(set(expected))
    f1s = []
    for label in labels:
        tp = sum(e == label and p == label for e, p in pairs)
        fp = sum(e != label and p == label for e, p in pairs)
        fn = sum(e == label and p != label for e, p in pairs)
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    confusions = Counter((e, p or "<failed>") for e, p in pairs if e != p)
    return {
        "accuracy": correct / len(pairs) if pairs else 0.0,
        "macro_f1": sum(f1s) / len(f1s) if f1s else 0.0,
        "confusions": [{"expected": e, "predicted": p, "count": n} for (e, p), n in confusions.most_common(10)],
    }


def normalize_value(value: Any) -> Any:
    """What "the same value" means for extraction: case, accents, spacing and number format aside."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return round(float(value), 2)
    text = unicodedata.normalize("NFKC", str(value)).casefold().strip()
    text = re.sub(r"\s+", " ", text)
    number = re.sub(r"[^\d.\-]", "", text)
    if number and re.fullmatch(r"-?\d+(\.\d+)?", number) and len(number) >= len(text) - 4:
        return round(float(number), 2)  # "RM 9.00" and 9.0 are the same total
    return re.sub(r"[^\w ]", "", text)


def extraction_scores(expected: Sequence[Mapping[str, Any]], predicted: Sequence[Mapping[str, Any] | None]
                      ) -> dict[str, Any]:
    """Per-field exact and normalized match rates; accuracy = share of documents whose every
    expected field matches after normalization."""
    fields = sorted({f for e in expected for f in e})
    exact = Counter[str]()
    normalized = Counter[str]()
    all_match = 0
    for gold, got in zip(expected, predicted, strict=True):
        got = got or {}
        ok = True
        for field in fields:
            if field not in gold:
                continue
            exact[field] += gold[field] == got.get(field)
            same = normalize_value(gold[field]) == normalize_value(got.get(field))
            normalized[field] += same
            ok = ok and same
        all_match += ok
    n = len(expected)
    return {
        "accuracy": all_match / n if n else 0.0,
        "fields": {f: {"exact": exact[f] / n, "normalized": normalized[f] / n} for f in fields} if n else {},
    }
