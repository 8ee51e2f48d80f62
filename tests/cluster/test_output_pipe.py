"""The output pipe (cluster/workers/output_pipe.py) over real loopback sockets: a worker's outputs reach
the router's queue in order, a connection without the secret is never read, a closed pipe fails
the requests opened on it and the sender reconnects, and the worker's call decides how a
request's outputs end. Through a real cluster: tests/cluster/test_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import time

import pytest

from pdserve.cluster.workers.output_pipe import OutputPipe, PipeAddress, PipeSender, frame
from pdserve.engine.outputs import CompletionOutput, RequestOutput


def out(rid: str, tok: int, finished: bool = False) -> RequestOutput:
    o = RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "", [tok])], finished)
    o.delta_token_ids = [tok]
    return o


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def connected_pipe(worker: str = "w0"):
    """A router's pipe and one worker's sender, connected; both closed after."""
    pipe = OutputPipe()
    sender = PipeSender(await pipe.start("127.0.0.1"), worker)
    try:
        await until(lambda: pipe.connected(worker))
        yield pipe, sender
    finally:
        sender.close()
        pipe.close()


async def read_all(pipe: OutputPipe, rid: str, worker: str, call) -> list:
    return [o async for o in pipe.outputs(rid, worker, call)]


def test_outputs_arrive_in_order_and_the_call_ends_them():
    async def main():
        async with connected_pipe() as (pipe, sender):
            assert not pipe.connected("w1")
            done = asyncio.get_running_loop().create_future()

            def call():  # the worker's generate_piped: it starts sending once called
                for t in range(10):
                    sender.send("r1", out("r1", t, finished=t == 9))
                return done

            task = asyncio.ensure_future(read_all(pipe, "r1", "w0", call))
            await asyncio.sleep(0.05)
            done.set_result(True)
            got = await asyncio.wait_for(task, 10)
            assert [o.delta_token_ids[0] for o in got] == list(range(10)) and got[-1].finished
            assert pipe.queues == {}  # closed with its last output

            # the call's error ends the outputs with it; False (aborted there) ends them quietly
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(ValueError("prompt too long"))
            with pytest.raises(ValueError, match="prompt too long"):
                await read_all(pipe, "r2", "w0", lambda: failed)
            aborted = asyncio.get_running_loop().create_future()
            aborted.set_result(False)
            assert await read_all(pipe, "r3", "w0", lambda: aborted) == []
            # an output for a request no one reads is dropped, not kept
            sender.send("gone", out("gone", 1))
            ok = asyncio.get_running_loop().create_future()

            def call4():
                sender.send("r4", out("r4", 7, finished=True))
                ok.set_result(True)
                return ok
            assert [o.delta_token_ids for o in await read_all(pipe, "r4", "w0", call4)] == [[7]]
            assert pipe.queues == {}

    asyncio.run(main())


def test_a_connection_without_the_secret_is_closed_unread(tmp_path):
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    async def main():
        pipe = OutputPipe()
        address = await pipe.start("127.0.0.1")
        host, port = address.host, address.port

        def intrude():
            with socket.create_connection((host, port)) as s:
                s.sendall(frame(b'{"worker": "w0", "secret": "guess"}') + frame(pickle.dumps([("r", Evil())])))
                s.settimeout(5)
                return s.recv(1)  # b"": the router closed it

        assert await asyncio.get_running_loop().run_in_executor(None, intrude) == b""
        assert not pipe.connected("w0") and not marker.exists()
        pipe.close()

    asyncio.run(main())


def test_a_closed_pipe_fails_its_requests_and_the_sender_reconnects(monkeypatch):
    import pdserve.cluster.workers.output_pipe as op

    monkeypatch.setattr(op, "DEATH_S", 0.2)

    async def main():
        async with connected_pipe() as (pipe, sender):
            never = asyncio.get_running_loop().create_future()

            def call():
                sender.send("r1", out("r1", 5))
                return never

            got = []

            async def consume():
                async for o in pipe.outputs("r1", "w0", call):
                    got.append(o)

            task = asyncio.ensure_future(consume())
            await until(lambda: got)
            first = pipe.links["w0"]
            first.transport.abort()  # the connection breaks (the router's side)
            with pytest.raises(ConnectionError, match="w0: its output pipe closed"):
                await asyncio.wait_for(task, 10)
            assert [o.delta_token_ids for o in got] == [[5]]
            await until(lambda: pipe.connected("w0") and pipe.links["w0"] is not first)  # back
            done = asyncio.get_running_loop().create_future()

            def call2():
                sender.send("r2", out("r2", 6, finished=True))
                done.set_result(True)
                return done
            assert [o.delta_token_ids for o in await read_all(pipe, "r2", "w0", call2)] == [[6]]
            with pytest.raises(ConnectionError, match="w9: no output pipe"):
                await read_all(pipe, "r3", "w9", lambda: done)

    asyncio.run(main())


def test_a_last_output_that_never_comes_fails_the_request(monkeypatch):
    """The worker said its last output is on the pipe, but it never arrives (a frame lost with a
    connection the router has not yet seen close): the request fails instead of waiting forever."""
    import pdserve.cluster.workers.output_pipe as op

    monkeypatch.setattr(op, "LAST_OUTPUT_S", 0.2)

    async def main():
        async with connected_pipe() as (pipe, sender):
            done = asyncio.get_running_loop().create_future()
            done.set_result(True)
            with pytest.raises(ConnectionError, match="did not arrive within 0.2 s"):
                await read_all(pipe, "r1", "w0", lambda: done)

    asyncio.run(main())


def test_the_sender_keeps_trying_a_router_that_is_not_there_yet():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        sender = PipeSender(PipeAddress("127.0.0.1", port, "s"), "w0")
        try:
            await asyncio.sleep(0.3)
            assert not sender.alive
            server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
            await until(lambda: sender.alive)
            server.close()
        finally:
            sender.close()

    asyncio.run(main())


def test_a_pipe_closed_by_its_workers_death_fails_with_the_death():
    """The pipe closes first when a worker dies; its call's error (Ray's actor death) follows and
    is what the request fails with, so dispatch takes the worker out of placement."""

    class Died(Exception):
        pass

    async def main():
        async with connected_pipe() as (pipe, sender):
            call = asyncio.get_running_loop().create_future()

            async def die():
                pipe.links["w0"].transport.abort()
                await asyncio.sleep(0.3)
                call.set_exception(Died("the worker process ended"))
            with pytest.raises(Died):
                await asyncio.gather(read_all(pipe, "r1", "w0", lambda: call), die())

    asyncio.run(main())


def test_a_call_that_ends_before_its_last_output_arrives_waits_for_it():
    """The worker's call returns as soon as the last output is handed to its sender, which may be
    before the frame reaches the router: the reader waits for it (the call's end does not cut the
    outputs short), and a reader cancelled meanwhile leaves no get pending."""
    async def main():
        async with connected_pipe() as (pipe, sender):
            ended = asyncio.get_running_loop().create_future()

            async def late():
                sender.send("r1", out("r1", 1))
                await asyncio.sleep(0.1)
                ended.set_result(True)  # the call is over while the reader waits for the next output
                await asyncio.sleep(0.2)
                sender.send("r1", out("r1", 2, finished=True))

            got, _ = await asyncio.gather(read_all(pipe, "r1", "w0", lambda: ended), late())
            assert [o.delta_token_ids for o in got] == [[1], [2]] and got[-1].finished
            never = asyncio.get_running_loop().create_future()
            reader = asyncio.ensure_future(read_all(pipe, "r2", "w0", lambda: never))
            await asyncio.sleep(0.05)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await asyncio.sleep(0)
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
            assert not any("Queue.get" in repr(t.get_coro()) for t in pending), pending
            assert pipe.queues == {}

    asyncio.run(main())
