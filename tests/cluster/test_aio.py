"""`within`, the request path's timeout: a cancellation that meets the awaited result in the
same loop turn still cancels the caller (asyncio.wait_for on Python 3.10 and 3.11 returns the
result instead: a client gone for good whose request went on generating)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.aio import within


def _cancelled_as_the_result_lands(wait) -> str:
    async def main():
        inner = asyncio.get_running_loop().create_future()
        caller = asyncio.ensure_future(wait(inner, 10))
        await asyncio.sleep(0)  # the caller waits on inner
        inner.set_result("answer")  # the answer and the client's cancellation, in one turn
        caller.cancel()
        try:
            return await caller
        except asyncio.CancelledError:
            return "cancelled"

    return asyncio.run(main())


def test_a_cancellation_that_meets_the_result_is_not_lost():
    assert _cancelled_as_the_result_lands(within) == "cancelled"


def test_within_times_out_and_cancels_what_it_waited_on():
    async def main():
        slow = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await within(slow, 0.05)
        await asyncio.sleep(0)
        return slow.cancelled(), await within(asyncio.sleep(0, "ok"), 1)

    assert asyncio.run(main()) == (True, "ok")
