"""The review page's sign-in throttle (etl.web.app.Throttle), as a hostile review found it wanting:
concurrent guesses all passed before the first failure was counted, and a flood of names cleared
every login's count."""

from __future__ import annotations

from etl.web.app import FAILURES, Throttle


def test_attempts_are_counted_when_they_start_so_concurrent_guesses_cannot_all_pass() -> None:
    throttle = Throttle()
    started = [throttle.begin("bob", f"10.0.0.{n}") for n in range(100)]  # none has failed yet
    assert sum(mark is not None for mark in started) == FAILURES
    other = throttle.begin("alice", "10.0.0.1")
    assert other is not None  # another login is not locked out by bob's guesses
    throttle.succeeded("alice", "10.0.0.1", other)
    assert all(throttle.begin("alice", "10.0.0.1") is not None for _ in range(FAILURES - 1))


def test_a_flood_of_names_refuses_new_attempts_rather_than_forget_a_login_s_count() -> None:
    throttle = Throttle()
    throttle.MAX_KEYS = 1000  # type: ignore[misc]  # the flood, scaled down
    for _ in range(FAILURES):
        assert throttle.begin("bob", "10.0.0.1") is not None
    for n in range(600):
        throttle.begin(f"name{n}", f"10.1.{n // 250}.{n % 250}")
    assert throttle.begin("bob", "10.9.9.9") is None  # still counted (or everything refused): never reset
