"""The client-side rate limit holds requests back (a lower bound on time, never an upper one)."""

import asyncio
import time

from etl.llm.ratelimit import RateLimit


async def test_requests_per_second_are_spaced() -> None:
    limit = RateLimit(requests_per_s=20)
    started = time.monotonic()
    await asyncio.gather(*(limit.acquire(1) for _ in range(31)))
    # a bucket of 20 lets 20 through at once; the other 11 need 11/20 s more
    assert time.monotonic() - started >= 0.5


async def test_tokens_per_minute_are_budgeted() -> None:
    limit = RateLimit(tokens_per_min=6000)  # 100 tokens a second, a minute's worth in the bucket
    await limit.acquire(6000)
    started = time.monotonic()
    await limit.acquire(50)
    assert time.monotonic() - started >= 0.45


async def test_no_limit_never_waits_and_none_is_the_default() -> None:
    limit = RateLimit()
    for _ in range(1000):
        await limit.acquire(10**6)
