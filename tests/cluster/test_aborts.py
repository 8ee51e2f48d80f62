"""Aborts reach every worker whatever stage the request is at, on a real local Ray cluster
served by uvicorn: clients that leave leave nothing running or held.

How an abort travels: the client's disconnect cancels the router's request task
(router/runner.py), which cancels the dispatcher's attempt (cluster/dispatch/dispatch.py); the attempt
calls abort() on both of its workers. On a worker the abort is remembered (its wire id) and
posted to the engine thread, which drops the request from the stage it is in: queued or
prefilling (the engine), sending (the connector), waiting for blocks or receiving (the decode
role), decoding (the engine). An abort that reaches a worker before the request does (the
actor runs one caller's calls concurrently, in any order) keeps it from starting there.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import ray

from pdserve import SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.records import DecodeCall
from pdserve.router.app import build_app

from helpers import Server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

BUSY_KEYS = ("num_running", "num_waiting", "inflight", "open_outputs", "held_for_handoff", "waiting_for_kv",
             "request_blocks")


def busy(c: Cluster) -> dict:
    """What each worker still runs or holds for requests (all zero when quiet)."""
    return {r["worker_id"]: {k: r[k] for k in BUSY_KEYS if r.get(k)} for r in c.status()
            if any(r.get(k) for k in BUSY_KEYS)}


def wait_quiet(c: Cluster, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (left := busy(c)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return left


def test_an_abort_that_comes_before_its_request_keeps_it_from_starting(tiny_models):
    """abort() on a worker before its prefill() or generate(): the request never starts there
    (a prefill() fails with Aborted, a stream ends empty, a piped call answers False) and
    nothing is held; a request that was not aborted still serves."""
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, mode="disagg", max_model_len=256)
    try:
        workers = {w.role: w for w in c.pools.workers.values()}
        p, d = workers["prefill"].actor, workers["decode"].actor
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        request = c.validate(list(range(10, 60)), params)
        for rid in ("early-p", "early-d", "early-pipe"):
            ray.get((p if rid == "early-p" else d).abort.remote(rid))
        with pytest.raises(ray.exceptions.RayTaskError, match="request early-p aborted"):
            ray.get(p.prefill.remote("early-p", request, workers["decode"].worker_id), timeout=30)
        stream = d.generate.options(num_returns="streaming").remote(DecodeCall("early-d", request))
        assert [ray.get(ref) for ref in stream] == []
        if c.pipe is not None and c.pipe.connected(workers["decode"].worker_id):
            assert ray.get(d.generate_piped.remote(DecodeCall("early-pipe", request)), timeout=30) is False
        assert wait_quiet(c, 10) == {}
        out = c.generate([request.prompt_token_ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.outputs[0].finish_reason == "length"
    finally:
        c.shutdown()


def _leave(url_port: int, body: bytes, after_s: float) -> None:
    """A client that sends its request and closes the socket `after_s` later, before any reply."""
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", url_port)) as s:
        s.sendall(req)
        time.sleep(after_s)


@pytest.mark.parametrize("mode", ["disagg", "hybrid"])
def test_clients_that_leave_a_burst_leave_nothing_running(mode):
    """Bursts of clients that close their connection 0.5 s into a long chat request (the default
    model, 4000 tokens each: minutes of generation): 30 s after the clients left no worker runs
    or holds anything, and the next request is about as fast as before the bursts."""
    c = Cluster.start(prefill=1, decode=1, mode=mode, max_model_len=4096)
    server = Server(build_app(c))
    try:
        short = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}

        def timed() -> float:
            t = time.monotonic()
            r = httpx.post(server.url + "/v1/chat/completions", json=short, timeout=120)
            assert r.status_code == 200, r.text
            return time.monotonic() - t

        timed()  # warm
        before = min(timed() for _ in range(3))
        long = json.dumps({"messages": [{"role": "user", "content": "Write a long story"}], "max_tokens": 4000,
                           "min_tokens": 4000}).encode()
        for burst in range(3):
            clients = [threading.Thread(target=_leave, args=(server.port, long, 0.5)) for _ in range(48)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            left = wait_quiet(c, 30)
            assert left == {}, f"burst {burst}: 30 s after the clients left, workers still run or hold: {left}"
        after = min(timed() for _ in range(3))
        assert after < 3 * before + 1.0, (before, after)
    finally:
        server.stop()
        c.shutdown()
