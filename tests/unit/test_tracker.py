"""Only the contiguous low-watermark is ever committed, whatever order work finishes in."""

from etl.runtime.tracker import OffsetTracker
from schemas import Position


def p(offset: int, partition: int = 0) -> Position:
    return Position(stream="t", partition=partition, offset=offset)


def test_out_of_order_completion_commits_the_contiguous_prefix_only() -> None:
    t = OffsetTracker()
    for o in range(5):
        t.dispatch(p(o))
    t.complete(p(1))
    t.complete(p(2))
    assert t.take_watermarks() == {}  # 0 still in flight: nothing may be committed
    t.complete(p(0))
    assert t.take_watermarks() == {("t", 0): 3}
    t.complete(p(4))
    assert t.take_watermarks() == {}
    t.complete(p(3))
    assert t.take_watermarks() == {("t", 0): 5}
    assert t.in_flight == 0


def test_partitions_are_independent_and_forgettable() -> None:
    t = OffsetTracker()
    t.dispatch(p(10, 0))
    t.dispatch(p(20, 1))
    t.complete(p(20, 1))
    assert t.take_watermarks() == {("t", 1): 21}
    t.forget(("t", 0))
    assert t.in_flight == 0


def test_work_from_before_a_revocation_cannot_move_the_watermark() -> None:
    t = OffsetTracker()
    old = t.dispatch(p(100))
    t.forget(("t", 0))  # revoked, then assigned again from the stored position
    new = t.dispatch(p(100))
    t.complete(p(100), old)
    assert t.take_watermarks() == {}
    t.complete(p(100), new)
    assert t.take_watermarks() == {("t", 0): 101}
