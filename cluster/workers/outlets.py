"""Where a worker's engine thread hands each request's results.

    prefill()         a future (`done`): the handoff's result, or the output of a request
                      that ended on the prefill worker
    generate()        a queue (`streams`) on the actor's event loop, read by Ray's streaming
                      generator; outputs that pile up are merged into one (a slow reader
                      gets fewer, larger deltas)
    generate_piped()  the outputs go from the engine thread straight to the output pipe
                      (output_pipe.py), no hop through the event loop; a future (`piped`)
                      ends the Ray call once the last output is on the pipe, or with the
                      request's error

`deliver()` is the engine thread's one call; everything else runs on the actor's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pdserve.engine.outputs import RequestOutput, merge_outputs

from .output_pipe import PipeSender
from .worker_commands import Aborted


def relayed(out: RequestOutput) -> RequestOutput:
    """Stamps the first token's output (the one with spans) as it leaves the worker."""
    if out.metrics is not None and out.metrics.spans:
        out.metrics.spans["relayed"] = time.time()
    return out


class Outlets:
    def __init__(self, pipe: PipeSender | None = None):
        self.pipe = pipe
        self.aloop: asyncio.AbstractEventLoop | None = None  # the actor's event loop, set at start
        self.done: dict[str, asyncio.Future] = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self.piped: dict[str, asyncio.Future] = {}

    def requests(self) -> set[str]:
        """The requests a caller waits on."""
        return set(self.done) | set(self.streams) | set(self.piped)

    # ---- the engine thread ------------------------------------------------------------------------
    def deliver(self, request_id: str, result=None, output: RequestOutput | None = None,
                error: Exception | None = None) -> None:
        """Resolves the request's prefill() future, feeds its generate() stream, or sends its
        output down the pipe (and ends its generate_piped() call with the last one or an error)."""
        if output is not None and request_id in self.piped:
            self.pipe.send(request_id, relayed(output))
            if not output.finished:
                return

        def on_loop():
            last = result is not None or error is not None or (output is not None and output.finished)
            fut = self.done.pop(request_id, None) if last else None
            if fut is not None and not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(
                    result if result is not None else output)
            q = self.streams.get(request_id)
            if q is not None:
                q.put_nowait(error if error is not None else output)
            fut = self.piped.get(request_id) if last else None
            if fut is not None and not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(True)
        self.aloop.call_soon_threadsafe(on_loop)

    # ---- the actor's event loop -------------------------------------------------------------------
    def open_stream(self, request_id: str) -> asyncio.Queue:
        q = self.streams[request_id] = asyncio.Queue()
        return q

    async def stream(self, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """A generate() stream's outputs until the last; Aborted (the dispatcher asked, and reads
        no more) ends it quietly, since an error no one fetched is what Ray logs as unhandled."""
        while True:
            out = await q.get()
            if isinstance(out, Aborted):
                return
            if isinstance(out, Exception):
                raise out
            while not out.finished and not q.empty():  # the consumer fell behind: one item
                nxt = q.get_nowait()
                if isinstance(nxt, Aborted):
                    return
                if isinstance(nxt, Exception):
                    raise nxt
                out = merge_outputs(out, nxt)
            yield relayed(out)
            if out.finished:
                return

    def open_piped(self, request_id: str) -> asyncio.Future:
        if self.pipe is None or not self.pipe.alive:
            raise ConnectionError("this worker's output pipe is not connected")
        fut = self.piped[request_id] = asyncio.get_running_loop().create_future()
        return fut

    async def piped_end(self, request_id: str, fut: asyncio.Future | None) -> bool:
        """True once the request's last output is on the pipe; False if it was aborted here
        (fut None: before it started)."""
        try:
            return False if fut is None else await fut
        except Aborted:
            return False
        finally:
            self.piped.pop(request_id, None)
