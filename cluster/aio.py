"""`within(aw, timeout)`: asyncio.wait_for without its lost cancellation.

Python 3.10 and 3.11's `asyncio.wait_for` returns the awaited result when the caller is
cancelled in the same loop turn as that result arrives: the cancellation is swallowed and
the caller goes on (fixed in 3.12). In the request path that was a client gone for good whose
request went on generating on a decode worker: a burst of disconnects under load met a registry
answer in the same turn. `within` never swallows one: the caller's cancellation always
propagates, and cancels what it waited on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """`aw`'s result; asyncio.TimeoutError (and `aw` cancelled) after `timeout` seconds."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except asyncio.CancelledError:
        fut.cancel()
        raise
    if not done:
        fut.cancel()
        raise asyncio.TimeoutError
    return fut.result()
