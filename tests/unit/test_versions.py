"""What a polled message is to its document: the version rules, case by case."""

from __future__ import annotations

import pytest

from etl.runtime.versions import Route, route

A, B = "hash-a", "hash-b"


def at(offset: int, partition: int = 0) -> tuple[str, int, int]:
    return ("log", partition, offset)


@pytest.mark.parametrize(("message", "stored", "live", "content", "expected"), [
    (at(5), None, None, A, Route.STORED),                 # never seen
    (at(5), at(5), None, A, Route.STORED),                # a redelivery of the stored version
    (at(4), at(5), None, A, Route.OLDER),                 # an older line or offset read again
    (at(0, 1), at(9, 0), None, A, Route.NEWER),           # a higher partition is newer (tuple order)
    (at(0, 0), at(0, 1), None, A, Route.OLDER),
    (at(6), at(5), None, A, Route.NEWER),                 # an edit, or the same content again (a retry)
    (at(6), None, (A, at(5)), A, Route.RESTATE),          # the same content in flight at an older position
    (at(5), None, (A, at(5)), A, Route.WAIT),             # a redelivery of what is in flight
    (at(4), None, (A, at(5)), A, Route.WAIT),             # an older copy of what is in flight
    (at(6), at(4), (B, at(5)), A, Route.NEWER),           # A, B, A: never settled against A's old results
    (at(4), at(4), (B, at(5)), A, Route.STORED),          # a redelivery of the stored version, B in flight
    (at(4), None, (B, at(5)), A, Route.NEWER),            # another version in flight: the store decides
    (at(3), at(4), (B, at(5)), A, Route.OLDER),
])
def test_route(message: tuple[str, int, int], stored: tuple[str, int, int] | None,
               live: tuple[str, tuple[str, int, int]] | None, content: str, expected: Route) -> None:
    assert route(message, stored, live, content) is expected
