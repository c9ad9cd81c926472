"""The supervisor's exit status (``etl run --workers N``) from its children's, and its probes'
view of a child: the run says the drain deadline (3) as a single worker does, a child's failure
during the drain, or 0."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from etl.cli.workers import Child, exit_code
from etl.health import Probe


def child(returncode: int | None, *, past_deadline: bool = False) -> Child:
    return Child(0, Path("/nonexistent"), returncode=returncode, past_deadline=past_deadline)


@pytest.mark.parametrize(("codes", "expected"), [
    ([0, 0], 0),
    ([0, -signal.SIGTERM], 0),  # ended by the SIGTERM before it set its handler: nothing was read
    ([0, 3], 3),  # one hit its drain deadline
    ([1, 3], 3),
    ([0, 2], 2),  # failed while draining: said
    ([0, -signal.SIGKILL], 1),  # killed by something else: a failure, not a clean drain
    ([None, 0], 0),  # never started again after a crash, while stopping
])
def test_the_run_exits_with_the_worst_of_its_children(codes: list[int | None], expected: int) -> None:
    assert exit_code([child(code) for code in codes]) == expected


def test_a_child_the_supervisor_killed_after_the_deadline_is_the_deadline() -> None:
    assert exit_code([child(0), child(-signal.SIGKILL, past_deadline=True)]) == 3


def test_a_worker_still_starting_is_alive_and_not_ready() -> None:
    probe = Probe(stall_s=0.01)
    assert probe.alive()["ok"] and not probe.ready()["ok"]  # waiting for the store is not stuck
    probe.tick(assigned=True)
    assert probe.ready()["ok"]
    probe.beat -= 1  # type: ignore[operator]  # the loop has not turned for a second
    assert not probe.alive()["ok"] and not probe.ready()["ok"]
