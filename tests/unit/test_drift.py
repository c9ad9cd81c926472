"""label_shift on banking77's real label mix: false alarms on a shuffled stationary stream, and power.

The stream is the 10,003 training labels (77 intents) shuffled; a check compares the last window of
it with its first ``max(window, BASELINE)`` labels, as ``etl drift`` does. Measured with 1,000 checks
per window size (``python -m tests.unit.test_drift``, figures in the README); these tests run fewer
checks, with bounds their binomial noise keeps far from.
"""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from etl.quality.drift import BASELINE, Thresholds, label_shift

LABELS = [row["category"] for row in csv.DictReader(
    (Path(__file__).parents[2] / "examples" / "data" / "banking77_train.csv").open(encoding="utf-8"))]
ALPHA = Thresholds().label_alpha


def windows(w: int, seed: int, baseline: int = BASELINE) -> tuple[list[str], list[str]]:
    stream = list(np.random.default_rng(seed).permutation(LABELS))
    return stream[:max(w, baseline)], stream[-w:]


def shifted(recent: list[str], label: str, points: float) -> list[str]:
    """``recent`` with ``label``'s share raised by ``points`` above its share of the whole stream."""
    k = round((LABELS.count(label) / len(LABELS) + points) * len(recent))
    return [label] * k + [x for x in recent if x != label][: len(recent) - k]


@pytest.mark.parametrize("w", [50, 100, 200, 500])
def test_false_alarms_on_a_stationary_stream_stay_under_one_percent(w: int) -> None:
    checks = 150
    alarms = sum(label_shift(*windows(w, seed), seed=seed)[0] < ALPHA for seed in range(checks))
    assert alarms <= 1  # ≤ 1% would allow 1.5; at alpha 0.001 the expectation is 0.15


def detected(w: int, checks: int, baseline: int = BASELINE) -> int:
    """Checks (of ``checks``) that find a 20-point rise of a random label in the last window."""
    rng = np.random.default_rng(w)
    found = 0
    for seed in range(checks):
        base, recent = windows(w, seed, baseline)
        label = LABELS[rng.integers(len(LABELS))]
        p, moved = label_shift(base, shifted(recent, label, 0.20), seed=seed)
        found += p < ALPHA
        assert p >= ALPHA or moved == label  # an alert names the label that moved
    return found


@pytest.mark.parametrize("w", [50, 100, 200, 500])
def test_a_twenty_point_shift_of_one_label_is_detected(w: int) -> None:
    assert detected(w, 40) >= 0.97 * 40


def test_a_baseline_as_small_as_the_window_cannot_find_it_in_50() -> None:
    """Why the baseline is long: 10 documents of one intent among 50 against 50 others is noise to
    any test whose false alarms stay rare (measured: found in 65 of 1,000 checks)."""
    assert detected(50, 40, baseline=50) <= 0.3 * 40


def test_the_p_value_is_seeded_and_exact_on_small_cases() -> None:
    base, recent = Counter(a=30, b=30), Counter(a=30, b=30)
    assert label_shift(base, recent) == label_shift(base, recent)
    assert label_shift(base, recent)[0] == 1.0  # the observed split is the most typical one
    p, moved = label_shift(Counter(a=60), Counter(b=60), permutations=999)
    assert p == 2 / 1000 and moved == "a"  # no random split is as extreme: p at its floor
    assert label_shift({}, Counter(a=3)) == (1.0, "")  # an empty window tests nothing


def test_thresholds_refuse_a_level_no_affordable_test_reaches() -> None:
    from etl.errors import ConfigError

    for alpha in (0.0, 1e-6, 1.0):
        with pytest.raises(ConfigError):
            Thresholds(label_alpha=alpha)


if __name__ == "__main__":  # the README's figures: 1,000 checks per window size
    for w in (50, 100, 200, 500):
        alarms = sum(label_shift(*windows(w, seed), seed=seed)[0] < ALPHA for seed in range(1000))
        print(f"window {w}, baseline {max(w, BASELINE)}: false alarms {alarms}/1000, "
              f"20-point rise found {detected(w, 1000)}/1000, with a baseline of {w}: {detected(w, 1000, w)}/1000",
              flush=True)
