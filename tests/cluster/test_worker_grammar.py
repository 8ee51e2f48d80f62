"""A worker compiles a request's grammar on its compile thread, before the engine thread sees
the request: the other requests' steps go on meanwhile, and a request aborted while its grammar
compiles never starts."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from pdserve import SamplingParams
from pdserve.cluster import Cluster
from pdserve.engine.sample.structured import Grammars

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

# seconds to compile on the default tokenizer's vocabulary (no compile is cached across processes)
SLOW = {"regex": "(" + "|".join(f"[a-z]{{{k}}}x" for k in range(1, 200)) + "){1,50}"}


@pytest.fixture(scope="module")
def cluster(tiny_models):
    c = Cluster.start(tiny_models["llama"], decode=1, mode="colocated", max_model_len=512)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def compile_s(cluster):
    """What compiling SLOW takes here (a fresh compiler, this process)."""
    t = time.monotonic()
    Grammars(lambda: cluster.tokenizer, cluster.vocab_size).compile(SLOW)
    took = time.monotonic() - t
    assert took > 1.0, f"SLOW compiled in {took:.2f} s: too fast to show a stall"
    return took


def worker_stats(cluster) -> dict:
    (rec,) = cluster.pools.workers.values()
    return ray.get(rec.actor.stats.remote()).as_dict()


def test_a_new_grammar_never_holds_up_the_steps_of_other_requests(cluster, compile_s):
    arrivals: list[float] = []
    first = threading.Event()

    def sink(out):
        arrivals.append(time.monotonic())
        first.set()

    long = cluster.submit(None, cluster.validate(list(range(100, 140)), SamplingParams(
        temperature=0, max_tokens=400, ignore_eos=True)), sink)
    assert first.wait(60)
    got = []
    t0 = time.monotonic()
    constrained = cluster.submit(None, cluster.validate(list(range(200, 220)), SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=SLOW)), got.append)
    constrained.result(timeout=120)
    t1 = time.monotonic()
    long.result(timeout=120)
    assert t1 - t0 > compile_s / 2  # its grammar compiled on the worker meanwhile
    during = [t for t in arrivals if t0 <= t <= t1]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) > 10 and max(gaps) < compile_s / 3, (len(during), max(gaps, default=None), compile_s)
    text = "".join(o.outputs[0].text for o in got)
    assert text and set(text) <= set("abcdefghijklmnopqrstuvwxyz"), text


def test_a_request_aborted_while_its_grammar_compiles_never_starts(cluster, compile_s):
    grammar = {"regex": SLOW["regex"] + "y"}  # another grammar: not in the worker's cache yet
    queries = worker_stats(cluster)["prefix_cache_queries"]
    fut = cluster.submit(None, cluster.validate(list(range(300, 340)), SamplingParams(
        temperature=0, max_tokens=300, structured_outputs=grammar)), lambda out: None)
    time.sleep(min(1.0, compile_s / 4))  # the worker is compiling it
    fut.cancel()
    # the same grammar again, now cached: the compile thread takes it after the aborted one
    again = cluster.submit(None, cluster.validate(list(range(400, 420)), SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=grammar)), lambda out: None)
    again.result(timeout=120)
    deadline = time.monotonic() + 30
    while (s := worker_stats(cluster))["inflight"] or s["request_blocks"] or s["open_outputs"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
    # prompt tokens looked up in the prefix cache: the second request's 20, none of the aborted one's 40
    assert s["prefix_cache_queries"] - queries == 20, s

