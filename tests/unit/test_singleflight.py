"""Concurrent duplicates share one computation; failures are never remembered."""

import asyncio

import pytest

from dedup import SingleFlight


async def test_concurrent_callers_share_one_call() -> None:
    calls = 0

    async def compute() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return "answer"

    flight: SingleFlight[str] = SingleFlight()
    results = await asyncio.gather(*(flight.do("k", compute) for _ in range(10)))
    assert calls == 1
    assert [r for r, _ in results] == ["answer"] * 10
    assert sum(shared for _, shared in results) == 9
    # Finished but not yet forgotten: a late duplicate is still served without a call.
    assert await flight.do("k", compute) == ("answer", True)
    flight.forget(["k"])
    await flight.do("k", compute)
    assert calls == 2


async def test_failures_are_shared_but_not_cached() -> None:
    calls = 0

    async def boom() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        raise RuntimeError("model down")

    flight: SingleFlight[str] = SingleFlight()
    results = await asyncio.gather(*(flight.do("k", boom) for _ in range(3)), return_exceptions=True)
    assert calls == 1 and all(isinstance(r, RuntimeError) for r in results)
    with pytest.raises(RuntimeError):
        await flight.do("k", boom)
    assert calls == 2
