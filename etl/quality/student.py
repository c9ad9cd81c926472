"""A student: a cheap classifier trained on a Classify stage's validated answers, kept as plain data.

Word and character n-gram TF-IDF and multinomial logistic regression (scikit-learn), trained on
the LLM's stored answers. What is stored is data only — vocabularies as JSON, IDF weights and
coefficients as little-endian float arrays with their shapes — and loading it builds the same
vectorizers and a softmax over ``X @ W.T + b``: nothing is unpickled, nothing runs on load.

:func:`certify` picks the student's confidence threshold on labelled documents it did not train
on, by fixed-sequence testing (Learn-then-Test): thresholds from the most confident coverage down,
each tested with a one-sided Clopper-Pearson lower bound; the last threshold whose bound meets the
target is kept, and the family of tests holds at the stated level without splitting the slice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import sparse
from scipy.stats import beta

#: The feature families, in order. Changing them is a new format (students of the old one are refused).
FEATURES: tuple[dict[str, Any], ...] = (
    {"analyzer": "word", "ngram_range": [1, 2], "lowercase": True, "sublinear_tf": True, "min_df": 2},
    {"analyzer": "char_wb", "ngram_range": [2, 5], "lowercase": True, "sublinear_tf": True, "min_df": 2},
)
FORMAT = 1
#: Inverse regularisation of the logistic regression: on banking77 (9,000 noisy LLM labels) 5 gave
#: the most coverage at accuracy >= 0.95 of 5, 10 and 20.
C = 5.0
_DTYPES = {"<f4", "<f8"}  # all a stored array may be: no object arrays, nothing that runs code


def lower_bound(correct: int, n: int, level: float = 0.95) -> float:
    """One-sided Clopper-Pearson lower bound on a proportion (0 when n is 0)."""
    if n == 0 or correct == 0:
        return 0.0
    return float(beta.ppf(1 - level, correct, n - correct + 1))


def upper_bound(correct: int, n: int, level: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound on a proportion (1 when n is 0)."""
    if n == 0 or correct == n:
        return 1.0
    return float(beta.ppf(level, correct + 1, n - correct))


def _vectorizer(spec: dict[str, Any], vocabulary: dict[str, int] | None = None) -> Any:
    from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415 - heavy; only the router needs it

    return TfidfVectorizer(analyzer=spec["analyzer"], ngram_range=tuple(spec["ngram_range"]),
                           lowercase=spec["lowercase"], sublinear_tf=spec["sublinear_tf"],
                           min_df=1 if vocabulary is not None else spec["min_df"], vocabulary=vocabulary,
                           dtype=np.float64)


@dataclass
class Student:
    """A trained student: ``predict`` gives each text's label and the probability the student gives it."""

    classes: list[str]
    vectorizers: list[Any]
    coef: np.ndarray  # (classes, features)
    intercept: np.ndarray  # (classes,)
    _prepared: list[tuple[Any, Any, np.ndarray]] | None = None

    @classmethod
    def train(cls, texts: Sequence[str], labels: Sequence[str], seed: int = 0) -> Student:
        """Fits the student. Raises ValueError for fewer than two distinct labels."""
        from sklearn.linear_model import LogisticRegression  # noqa: PLC0415

        if len(set(labels)) < 2:
            raise ValueError("the answers hold fewer than two labels: nothing to learn")
        vectorizers = [_vectorizer(spec) for spec in FEATURES]
        features = sparse.hstack([v.fit_transform(texts) for v in vectorizers]).tocsr()
        model = LogisticRegression(C=C, max_iter=300, random_state=seed).fit(features, list(labels))
        coef, intercept = model.coef_, model.intercept_
        if len(model.classes_) == 2:  # scikit-learn keeps one row for two classes: make it a softmax
            coef, intercept = np.vstack([-coef[0] / 2, coef[0] / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
        return cls([str(c) for c in model.classes_], vectorizers, coef.astype(np.float32),
                   intercept.astype(np.float32))

    def probabilities(self, texts: Sequence[str]) -> np.ndarray:
        features = sparse.hstack([v.transform(texts) for v in self.vectorizers]).tocsr()
        scores = np.asarray(features @ self.coef.T.astype(np.float64)) + self.intercept
        scores -= scores.max(axis=1, keepdims=True)
        np.exp(scores, out=scores)
        return scores / scores.sum(axis=1, keepdims=True)

    def predict_one(self, text: str) -> tuple[str, float]:
        """:meth:`predict` for one text without scikit-learn's per-call overhead (a document at a
        time, on the run's loop): the same features, looked up term by term."""
        columns: list[int] = []
        values: list[float] = []
        offset = 0
        for vectorizer, analyze, idf in self._analyzers():
            counts: dict[int, int] = {}
            vocabulary = vectorizer.vocabulary_
            for term in analyze(text):
                j = vocabulary.get(term)
                if j is not None:
                    counts[j] = counts.get(j, 0) + 1
            if counts:
                idx = np.fromiter(counts, dtype=np.int64, count=len(counts))
                tf = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
                weights = (np.log(tf) + 1.0) * idf[idx]
                weights /= np.sqrt(np.dot(weights, weights))
                columns.extend((idx + offset).tolist())
                values.extend(weights.tolist())
            offset += len(vocabulary)
        scores = self.intercept.astype(np.float64)
        if columns:
            scores = scores + self.coef[:, columns].astype(np.float64) @ np.asarray(values)
        scores = np.exp(scores - scores.max())
        best = int(scores.argmax())
        return self.classes[best], float(scores[best] / scores.sum())

    def _analyzers(self) -> list[tuple[Any, Any, np.ndarray]]:
        if self._prepared is None:
            self._prepared = [(v, v.build_analyzer(), v.idf_) for v in self.vectorizers]
        return self._prepared

    def predict(self, texts: Sequence[str]) -> tuple[list[str], np.ndarray]:
        """(label, confidence) for each text: the most probable class and its probability."""
        if not texts:
            return [], np.zeros(0)
        p = self.probabilities(texts)
        best = p.argmax(axis=1)
        return [self.classes[i] for i in best], p[np.arange(len(texts)), best]

    # -- plain data ---------------------------------------------------------------------------

    def dump(self) -> tuple[dict[str, Any], bytes]:
        """(spec as JSON-able data, the float arrays' bytes): what the store keeps."""
        arrays: list[tuple[str, np.ndarray]] = [(f"idf{i}", v.idf_.astype("<f8")) for i, v in enumerate(self.vectorizers)]
        arrays += [("coef", self.coef.astype("<f4")), ("intercept", self.intercept.astype("<f4"))]
        spec = {
            "format": FORMAT, "classes": self.classes,
            "features": [{**FEATURES[i], "vocabulary": sorted(v.vocabulary_, key=v.vocabulary_.__getitem__)}
                         for i, v in enumerate(self.vectorizers)],
            "arrays": [{"name": name, "dtype": a.dtype.str, "shape": list(a.shape)} for name, a in arrays],
        }
        return spec, b"".join(a.tobytes() for _, a in arrays)

    @classmethod
    def load(cls, spec: dict[str, Any], blob: bytes) -> Student:
        """The student from :meth:`dump`'s data. Raises ValueError if the data is not a student of
        this format (wrong shapes, types or sizes)."""
        if not isinstance(spec, dict):
            raise ValueError(f"student spec is a {type(spec).__name__}, not an object")
        if spec.get("format") != FORMAT:
            raise ValueError(f"student format {spec.get('format')!r}; this version reads {FORMAT}")
        arrays: dict[str, np.ndarray] = {}
        offset = 0
        for item in spec["arrays"]:
            if item["dtype"] not in _DTYPES:
                raise ValueError(f"array {item['name']!r} has dtype {item['dtype']!r}")
            dtype = np.dtype(item["dtype"])
            count = math.prod(item["shape"])
            end = offset + count * dtype.itemsize
            if end > len(blob):
                raise ValueError("student weights are shorter than their spec says")
            arrays[item["name"]] = np.frombuffer(blob, dtype, count, offset).reshape(item["shape"])
            offset = end
        if offset != len(blob):
            raise ValueError("student weights are longer than their spec says")
        if not all(np.isfinite(a).all() for a in arrays.values()):
            raise ValueError("student weights hold NaN or infinite values")
        if len(spec["features"]) != len(FEATURES):
            raise ValueError(f"student has {len(spec['features'])} feature families; this version reads {len(FEATURES)}")
        vectorizers = []
        for i, feature in enumerate(spec["features"]):
            if {k: v for k, v in feature.items() if k != "vocabulary"} != FEATURES[i]:
                raise ValueError(f"student feature family {i} differs from this version's")
            vocabulary = {term: j for j, term in enumerate(feature["vocabulary"])}
            vectorizer = _vectorizer(feature, vocabulary)
            vectorizer.idf_ = np.array(arrays[f"idf{i}"], dtype=np.float64)
            vectorizers.append(vectorizer)
        coef, intercept = arrays["coef"], arrays["intercept"]
        width = sum(len(f["vocabulary"]) for f in spec["features"])
        if coef.shape != (len(spec["classes"]), width) or intercept.shape != (len(spec["classes"]),):
            raise ValueError("student coefficients do not match its classes and features")
        return cls(list(spec["classes"]), vectorizers, coef, intercept)


@dataclass(frozen=True)
class Certificate:
    """What :func:`certify` found on a labelled slice."""

    threshold: float | None  # None: no threshold meets the target
    covered: int  # documents of the slice at or above the threshold
    correct: int  # of them, those whose label the student got right
    slice: int  # documents in the slice
    lower_bound: float  # of correct / covered at the threshold (0 when none)
    target: float
    level: float

    @property
    def coverage(self) -> float:
        return self.covered / self.slice if self.slice else 0.0

    @property
    def rate(self) -> float:
        return self.correct / self.covered if self.covered else 0.0


def certify(confidence: Sequence[float], correct: Sequence[bool], target: float, level: float = 0.95,
            step: int = 25, min_covered: int | None = None) -> Certificate:
    """The lowest confidence threshold whose accuracy (or agreement) on this slice has a one-sided
    ``level`` lower bound at least ``target``, by fixed-sequence testing: coverages of
    ``min_covered``, ``min_covered + step``, ... of the most confident documents (a grid fixed by
    confidences alone, never by labels) are tested in order, stopping at the first that fails.
    Every threshold before that failure holds together at ``level``. The sequence starts at a
    tenth of the slice (at least 50): a first test on a handful of documents would end it early."""
    order = np.argsort(-np.asarray(confidence, dtype=np.float64), kind="stable")
    conf = np.asarray(confidence, dtype=np.float64)[order]
    hits = np.cumsum(np.asarray(correct, dtype=bool)[order])
    n = len(conf)
    min_covered = min_covered or max(50, n // 10)
    best: tuple[float, int, int, float] | None = None
    for m in range(min_covered, n + 1, step):
        # Ties: a threshold covers every document as confident as its last one.
        covered = int(np.searchsorted(-conf, -conf[m - 1], side="right"))
        k = int(hits[covered - 1])
        bound = lower_bound(k, covered, level)
        if bound < target:
            break
        best = (float(conf[m - 1]), covered, k, bound)
    if best is None:
        return Certificate(None, 0, 0, n, 0.0, target, level)
    return Certificate(best[0], best[1], best[2], n, best[3], target, level)


def spec_json(spec: dict[str, Any]) -> str:
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
