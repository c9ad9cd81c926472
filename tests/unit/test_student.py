"""Students as plain data, the gate's bounds, and the shadow verdict — no store needed."""

from __future__ import annotations

import collections
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etl import Router
from etl.errors import ConfigError
from etl.quality.router import Live
from etl.quality.student import Student, certify, lower_bound, upper_bound

TEXTS = [f"{w} card {i}" for i in range(60) for w in ("lost", "stolen")] + \
        [f"transfer {w} {i}" for i in range(60) for w in ("pending", "failed")]
LABELS = ["lost_card"] * 120 + ["transfer"] * 120


@pytest.fixture(scope="module")
def student() -> Student:
    return Student.train(TEXTS, LABELS)


def test_a_student_is_json_and_floats_and_loads_to_the_same_answers(student: Student) -> None:
    spec, blob = student.dump()
    spec = json.loads(json.dumps(spec))  # nothing but JSON in the spec
    loaded = Student.load(spec, blob)
    probe = ["my card was stolen", "the transfer failed", "hello"]
    assert np.array_equal(loaded.probabilities(probe), student.probabilities(probe))
    labels, confidence = loaded.predict(probe)
    for text, label, conf in zip(probe, labels, confidence, strict=True):
        one = loaded.predict_one(text)
        assert one[0] == label and one[1] == pytest.approx(conf, abs=1e-9)
    assert labels[:2] == ["lost_card", "transfer"]


@pytest.mark.parametrize("tamper", ["dtype", "short", "long", "shape", "format", "list", "families", "nan"])
def test_loading_refuses_data_that_is_not_a_student_of_this_format(student: Student, tamper: str) -> None:
    spec, blob = student.dump()
    if tamper == "list":
        spec = [spec]  # type: ignore[assignment]
    elif tamper == "families":
        spec["features"].append(spec["features"][0])
    elif tamper == "nan":  # NaN weights would make every confidence NaN and every answer "sure"
        assert spec["arrays"][-1]["dtype"] == "<f4"  # the intercepts, last
        blob = blob[:-4] + np.array([np.nan], "<f4").tobytes()
    elif tamper == "dtype":
        spec["arrays"][0]["dtype"] = "|O"  # object arrays could hold anything: never read
    elif tamper == "short":
        blob = blob[:-4]
    elif tamper == "long":
        blob += b"\0" * 4
    elif tamper == "shape":
        spec["arrays"][-1]["shape"] = [3]
        spec["arrays"][-2]["shape"][0] = 3
        blob += b"\0" * (4 + 4 * spec["arrays"][-2]["shape"][1])
    else:
        spec["format"] = 99
    with pytest.raises(ValueError):
        Student.load(spec, blob)


def test_clopper_pearson_bounds() -> None:
    assert lower_bound(50, 50) == pytest.approx(0.05 ** (1 / 50))  # all right: (1 - level) ** (1/n)
    assert upper_bound(0, 50) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert lower_bound(0, 10) == 0.0 and upper_bound(10, 10) == 1.0 and lower_bound(0, 0) == 0.0
    assert lower_bound(90, 100) < 0.9 < upper_bound(90, 100)


def test_certify_keeps_the_last_threshold_of_the_sequence_that_holds() -> None:
    # 1,000 documents: the 600 most confident are right, the rest right one time in two.
    confidence = [1 - i / 1000 for i in range(1000)]
    correct = [i < 600 or i % 2 == 0 for i in range(1000)]
    cert = certify(confidence, correct, target=0.95)
    assert cert.threshold is not None and 600 <= cert.covered < 700
    assert cert.rate >= cert.lower_bound >= 0.95
    assert certify(confidence, correct, target=0.999).threshold is None  # needs more than the data shows


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=0, max_size=400),
       st.floats(0.5, 0.99))
def test_a_certificate_states_what_its_slice_holds(items: list[tuple[float, bool]], target: float) -> None:
    cert = certify([c for c, _ in items], [ok for _, ok in items], target)
    assert cert.slice == len(items)
    if cert.threshold is None:
        assert cert.covered == 0
        return
    above = [ok for c, ok in items if c >= cert.threshold]
    assert (cert.covered, cert.correct) == (len(above), sum(above))
    assert cert.lower_bound == pytest.approx(lower_bound(sum(above), len(above)))
    assert target <= cert.lower_bound <= cert.rate


def test_router_settings_are_checked_and_shadows_are_a_stable_share() -> None:
    with pytest.raises(ConfigError):
        Router(shadow_rate=1.5)
    with pytest.raises(ConfigError):
        Router(min_checks=300, window=200)
    keys = [f"{random.Random(i).getrandbits(256):064x}" for i in range(20_000)]
    router = Router(shadow_rate=0.02)
    share = sum(router.shadowed(k) for k in keys) / len(keys)
    assert 0.017 < share < 0.023
    assert [router.shadowed(k) for k in keys[:100]] == [router.shadowed(k) for k in keys[:100]]


def _live(router: Router, agreement_lb: float) -> Live:
    return Live(1, "t", "s", "f", 0.5, agreement_lb, 0.0, None, router,  # type: ignore[arg-type]
                collections.deque(maxlen=router.window))


def test_the_shadow_verdict_spares_a_healthy_student_and_catches_a_changed_llm() -> None:
    router = Router()
    rng = random.Random(3)
    false_offs = 0
    for _ in range(200):  # 200 healthy students, 400 checks each, agreeing as certified
        live = _live(router, 0.86)
        for _ in range(400):
            live.recent.append(rng.random() < 0.88)
            if live.verdict() is not None:
                false_offs += 1
                break
    assert false_offs <= 6  # measured 2 of 200 (seed 3): ~1% per 400 checks at 0.02 above the bound
    delays = []
    for _ in range(50):  # then the LLM changes: agreement falls to 0.4
        live = _live(router, 0.86)
        live.recent.extend(rng.random() < 0.88 for _ in range(200))
        for n in range(1, 201):
            live.recent.append(rng.random() < 0.4)
            if live.verdict() is not None:
                delays.append(n)
                break
    assert len(delays) == 50 and max(delays) <= 40  # measured at most 27 checks
