"""Faults on a real local Ray cluster (gloo transfer, tiny random models): a worker whose
engine thread died says so to every call and is replaced; a persisted host tier survives
a graceful restart with the same answers; the cluster is closed to other users."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.records import DecodeCall, WorkerRecord
from pdserve.cluster.spec.serving_config import HandoffConfig
from pdserve.cluster.workers.worker_actor import WorkerActor
from pdserve.router.app import build_app

from helpers import Server, role_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # a real-model or multi-actor cluster per module

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, frequency_penalty=0.3, repetition_penalty=1.1,
                        logprobs=2, max_tokens=24, seed=31, ignore_eos=True)


def colocated_tokens(model: str, prompts, params) -> list[list[int]]:
    with LLM(model, max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_a_worker_whose_engine_thread_died_refuses_calls_and_is_replaced(tiny_models):
    """The engine thread ends on an error outside the step's own guard (here its heartbeat
    raises what a persisted tier with string hashes once raised): its requests fail at once,
    ping and stats raise the reason, and the pools' monitor purges and replaces the worker."""
    c = Cluster.start(tiny_models["llama"], decode=1, mode="colocated", max_model_len=256)
    try:
        class HeartbeatBug(WorkerActor):
            def _heartbeat(self):
                raise TypeError("'str' object has no attribute 'hex'")

        sick = ray.remote(HeartbeatBug).options(namespace=c.pools.namespace, max_concurrency=100).remote(
            "sick-0", "decode", c.pools.spec("decode"), c.pools.namespace)
        ray.get(sick.start.remote())
        deadline = time.monotonic() + 30
        while True:
            try:
                ray.get(sick.ping.remote())
            except ray.exceptions.RayTaskError as e:
                assert "engine thread died: TypeError: 'str' object has no attribute 'hex'" in str(e)
                break
            assert time.monotonic() < deadline, "the engine thread's death was never reported"
            time.sleep(0.1)
        with pytest.raises(ray.exceptions.RayTaskError, match="sick-0 cannot serve: engine thread died"):
            ray.get(sick.stats.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match="cannot serve"):  # an answer (a hang: GetTimeoutError)
            ray.get(next(sick.generate.remote(DecodeCall("r", c.validate([1, 2, 3], GREEDY)))), timeout=120)
        async def join():  # as if the pools had started it: the monitor must see it cannot serve
            c.pools.workers["sick-0"] = WorkerRecord("sick-0", "decode", sick)

        c._run(join(), 10)
        deadline = time.monotonic() + 30
        while "sick-0" in c.pools.workers:
            assert time.monotonic() < deadline, "the monitor kept a worker that cannot serve"
            time.sleep(0.2)
        assert c.pool_sizes() == {"prefill": 0, "decode": 1}
        assert c.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0].finish_reason == "length"
    finally:
        c.shutdown()


def _pid(actor) -> int:
    import os

    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)


def test_a_silent_worker_is_out_of_placement_comes_back_and_is_purged_only_past_its_grace(tiny_models):
    """A decode worker frozen (SIGSTOP) past the probe's 5 s is silent, not dead: /health names it
    and says degraded, requests go to the pool's other worker and all finish, and once thawed it
    answers and serves again, the same worker. The whole pool frozen, a request waits for it
    instead of a 503 (a busy CI host's slow answer once purged the only decode worker and failed
    every request until a replacement started). Frozen past `unresponsive_s`, a worker is purged
    and replaced."""
    import os
    import signal

    c = Cluster.start(tiny_models["llama"], decode=2, mode="colocated", max_model_len=256)
    server = Server(build_app(c))
    try:
        first = sorted(c.workers)
        frozen = first[0]
        pid = _pid(c.workers[frozen].actor)
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait(lambda: frozen in c.health()["unresponsive"], 30, "the frozen worker was never reported")
            h = httpx.get(server.url + "/health", timeout=30)
            assert h.status_code == 200 and h.json()["status"] == "degraded" and frozen in h.json()["unresponsive"]
            outs = c.generate([[5 + i, 6, 7, 8] for i in range(6)], GREEDY)
            assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 6
            assert {o.decode_worker for o in outs} == {first[1]}  # none placed on the silent one
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait(lambda: not c.health()["unresponsive"], 30, "the thawed worker never answered again")
        assert sorted(c.workers) == first, "a worker silent for less than unresponsive_s was replaced"
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
        outs = c.generate([[9 + i, 6, 7, 8] for i in range(8)], GREEDY)
        assert {o.decode_worker for o in outs} == set(first)  # both serve again

        pids = [pid, _pid(c.workers[first[1]].actor)]  # the whole pool silent: a slow host, no 503
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        try:
            _wait(lambda: len(c.health()["unresponsive"]) == 2, 30, "the frozen pool was never reported")
            late: list = []
            t = threading.Thread(target=lambda: late.extend(c.generate([[5, 6, 7, 8]], GREEDY)))
            t.start()
            time.sleep(1.0)
        finally:
            for p in pids:
                os.kill(p, signal.SIGCONT)
        t.join(60)
        assert [o.outputs[0].finish_reason for o in late] == ["length"]
        assert sorted(c.workers) == first

        c.pools.unresponsive_s = 2.0
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait(lambda: frozen not in c.workers, 60, "a worker silent past unresponsive_s was kept")
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        _wait(lambda: len(c.workers) == 2 and not c.health()["unresponsive"], 120, "the pool was never refilled")
        assert c.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0].finish_reason == "length"
    finally:
        server.stop()
        c.shutdown()


RESTART_PROMPT = list(range(100, 200))  # 6 full blocks


def served_and_stopped(model: str, kw: dict) -> list[int]:
    """RESTART_PROMPT's greedy tokens from a plain engine, after a cluster built with `kw` has
    answered them too and been shut down (its tiers written as a graceful stop writes them)."""
    with LLM(model, max_model_len=256) as llm:
        want = llm.generate([RESTART_PROMPT], GREEDY)[0].outputs[0].token_ids
    c = Cluster.start(model, **kw)
    try:
        assert c.generate([RESTART_PROMPT], GREEDY)[0].outputs[0].token_ids == want
    finally:
        c.shutdown()
    return want


def test_a_graceful_restart_with_the_persisted_tier_answers_the_same(tiny_models, tmp_path):
    """Serve a prompt, stop the cluster at once (its blocks were freed by the last step, their
    copies to the host tier only queued), start it again: the same tokens, from the tier."""
    model, prompt = tiny_models["llama"], RESTART_PROMPT
    kw = dict(max_model_len=256, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path), mode="colocated", decode=1)
    want = served_and_stopped(model, kw)
    c = Cluster.start(model, **kw)
    try:
        (row,) = c.status()
        tier = row["kv_persist_status"]
        assert tier.startswith("restored 6 blocks from ") and "refused" not in tier
        out = c.generate([prompt], GREEDY)[0]
        assert out.outputs[0].token_ids == want and out.num_cached_tokens == 96
    finally:
        c.shutdown()


def test_a_cluster_restart_finds_the_disk_tier(tiny_models, tmp_path):
    """--kv-disk-dir in a real cluster: a prompt served, the cluster stopped (the worker's host tier
    goes to disk at close), started again with a worker of its own: once it has measured a
    prefill, the prompt's prefix comes back from the disk tier with the same tokens."""
    model, prompt = tiny_models["llama"], RESTART_PROMPT
    kw = dict(max_model_len=256, kv_offloading_size=0.001, kv_disk_dir=str(tmp_path), kv_disk_size=0.01,
              mode="colocated", decode=1)
    want = served_and_stopped(model, kw)
    c = Cluster.start(model, **kw)
    try:
        assert c.status()[0]["kv_disk_blocks"] >= 6
        c.generate([list(range(3000, 3100))], GREEDY)  # a prefill measured: the disk is weighed against it
        out = c.generate([prompt], GREEDY)[0]
        (row,) = c.status()
        assert out.outputs[0].token_ids == want and out.num_cached_tokens == 96
        assert row["prefix_cache_disk_hits"] == 96 and row["kv_disk_refused_blocks"] == 0, row
    finally:
        c.shutdown()


def slow_reply():
    """A real worker whose prefill() reply stays on the way for 30 s after its KV was sent:
    the window in which a prefill worker can die after the decode worker has what it needs.
    (Made in a function: Ray ships a local class by value, not by this test module's name.)"""

    class SlowReply(WorkerActor):
        async def prefill(self, *args, **kwargs):
            out = await super().prefill(*args, **kwargs)
            await asyncio.sleep(30)
            return out

    return SlowReply


def test_a_request_whose_kv_landed_survives_its_prefill_worker(tiny_models):
    model = tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = list(range(100, 140))
    with LLM(model, max_model_len=256) as llm:
        want = llm.generate([prompt], params)[0].outputs[0].token_ids
    c = Cluster.start(model, prefill=1, decode=1, max_model_len=256, worker_cls=slow_reply())
    try:
        outs, first = [], threading.Event()

        def sink(out):
            outs.append(out)
            first.set()

        fut = c.submit(None, c.validate(prompt, params), sink)
        assert first.wait(60)
        ray.kill(ray.get_actor(outs[0].prefill_worker, namespace="pdserve"))  # its reply still on the way
        fut.result(120)
        final = outs[-1].outputs[0]
        assert final.finish_reason == "length", final.stop_reason
        assert [t for o in outs for t in o.delta_token_ids] == want
    finally:
        c.shutdown()


def slow_start():
    """A real worker that waits 3 s before it prefills: the window in which a prefill worker
    can die before the client has seen a token (the dispatcher retries elsewhere)."""

    class SlowStart(WorkerActor):
        async def prefill(self, *args, **kwargs):
            await asyncio.sleep(3)
            return await super().prefill(*args, **kwargs)

    return SlowStart


def test_a_seeded_request_retried_after_its_prefill_worker_died_samples_the_same(tiny_models):
    """The prefill worker holding a seeded, sampled request dies before its first token; the
    dispatcher retries it on the other prefill worker and the client gets the colocated
    engine's tokens (the noise is a function of seed and output index, not of a worker)."""
    model = tiny_models["llama"]
    prompt = list(range(100, 150))
    want = colocated_tokens(model, [prompt], SEEDED)[0]
    c = Cluster.start(model, prefill=2, decode=1, max_model_len=256, worker_cls=slow_start())
    try:
        got = []
        t = threading.Thread(target=lambda: got.extend(c.generate([prompt], SEEDED, timeout=120)))
        t.start()
        deadline = time.monotonic() + 60
        while not (busy := [w["worker_id"] for w in c.status() if w["role"] == "prefill" and w["load"]]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ray.kill(ray.get_actor(busy[0], namespace="pdserve"))
        t.join(150)
        out, = got
        assert out.outputs[0].finish_reason == "length", out.outputs[0].stop_reason
        assert out.prefill_worker != busy[0] and role_of(c, out.prefill_worker) == "prefill"
        assert out.outputs[0].token_ids == want
    finally:
        c.shutdown()


def _kill_prefill_pool(c: Cluster) -> None:
    for w in c.status():
        if w["role"] == "prefill":
            ray.kill(ray.get_actor(w["worker_id"], namespace="pdserve"))


def test_an_empty_prefill_pool_is_a_503_with_retry_after_and_hybrid_prefills_on_decode(tiny_models):
    model = tiny_models["llama"]
    c = Cluster.start(model, prefill=1, decode=1, max_model_len=256)
    try:
        server = Server(build_app(c))
        try:
            _kill_prefill_pool(c)  # before the monitor has even seen it
            r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 4}, timeout=60)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"].startswith("no healthy prefill worker")
            assert int(r.headers["retry-after"]) >= 1
            deadline = time.monotonic() + 120  # the replacement serves
            while c.pool_sizes()["prefill"] < 1 or c.generate([[1, 2, 3]], GREEDY)[0].outputs[0].finish_reason \
                    == "error":
                assert time.monotonic() < deadline
                time.sleep(0.5)
        finally:
            server.stop()
    finally:
        c.shutdown()
    c = Cluster.start(model, prefill=1, decode=1, max_model_len=256, mode="hybrid")
    try:
        _kill_prefill_pool(c)
        out = c.generate([list(range(100, 180))], SEEDED)[0]  # prefilled on its decode worker, seeded
        assert out.outputs[0].finish_reason == "length" and out.prefill_worker == out.decode_worker
        assert out.outputs[0].token_ids == colocated_tokens(model, [list(range(100, 180))], SEEDED)[0]
        assert c.counters["routing"].get("no_prefill_worker", 0) >= 1
    finally:
        c.shutdown()


def test_a_worker_lost_mid_generation_reports_no_ray_internals(tiny_models):
    c = Cluster.start(tiny_models["llama"], decode=1, mode="colocated", max_model_len=256)
    try:
        outs, first = [], threading.Event()

        def sink(out):
            outs.append(out)
            first.set()

        fut = c.submit(None, c.validate(list(range(100, 120)), SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True)), sink)
        assert first.wait(60)
        ray.kill(ray.get_actor(outs[0].decode_worker, namespace="pdserve"))
        fut.result(120)
        final = outs[-1].outputs[0]
        assert final.finish_reason == "error" and final.stop_reason.endswith("died")
        for word in ("actor_id", "Actor ID", "ray::", "Traceback", "pid=", "ip="):
            assert word not in final.stop_reason
    finally:
        c.shutdown()


def _wait(cond, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(step)


def _registry_pid(c: Cluster) -> int | None:
    try:
        return ray.get(c.registry.actor.ping.remote(), timeout=10)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        return None


def test_the_registry_killed_or_frozen_under_load_comes_back_and_no_request_fails(tiny_models):
    """8 streams of prompts with full blocks through the HTTP router of a hybrid cluster while
    the block registry is SIGKILLed (Ray restarts it), frozen (SIGSTOP: the cluster kills it
    so that Ray restarts it) and killed for good (the cluster creates it again): every request
    is a 200 that runs to its length, /health says degraded while the registry is away and ok
    after, and each new registry learns the workers' cached blocks again."""
    import os
    import signal

    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, max_model_len=256, mode="hybrid")
    c.registry.frozen_s = 3.0
    server = Server(build_app(c))
    stop, results, healths = threading.Event(), [], []

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as h:
            k = 0
            while not stop.is_set():
                prompt = [10 + (i % 3) * 50 + j for j in range(36)] + [300 + k % 7]  # 2 full blocks, shared
                r = h.post(server.url + "/v1/completions",
                           json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
                results.append((r.status_code, r.json()["choices"][0]["finish_reason"] if r.status_code == 200
                                else r.text))
                k += 1

    def watch() -> None:
        while not stop.is_set():
            healths.append(httpx.get(server.url + "/health", timeout=30).json())
            time.sleep(0.05)

    def cached_again() -> bool:
        rows = c.registry_workers()
        return len(rows) == 2 and any(r.num_cached_blocks for r in rows)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: len(results) >= 16 and cached_again(), 120, "no load before the kill")
        pid = _registry_pid(c)
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: _registry_pid(c) not in (None, pid), 120, "never restarted")  # a fresh process, on a busy host
        n = len(results)
        _wait(lambda: cached_again() and len(results) >= n + 16, 60, "the workers never announced their blocks again")

        pid = _registry_pid(c)
        os.kill(pid, signal.SIGSTOP)  # frozen: calls time out, the probe too
        try:
            _wait(lambda: healths and healths[-1]["registry"]["status"] == "restarting", 30, "health never said so")
            assert healths[-1]["status"] == "degraded"
            n = len(results)
            _wait(lambda: len(results) >= n + 16, 60, "requests stopped while the registry was frozen")
            _wait(lambda: c.health()["registry"]["status"] == "ok", 60, "the frozen registry was never replaced")
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        _wait(cached_again, 60, "the restarted registry never learnt the blocks")

        ray.kill(c.registry.actor)  # for good: no restart
        _wait(lambda: c.health()["registry"]["recreated"] == 1 and c.health()["registry"]["status"] == "ok", 60,
              "the registry was never created again")
        n = len(results)
        _wait(lambda: cached_again() and len(results) >= n + 16, 60, "workers never joined the new registry")
        _wait(lambda: healths[-1]["status"] == "ok", 30, "health stayed degraded")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        server.stop()
        c.shutdown()
    bad = [r for r in results if r != (200, "length")]
    assert not bad, f"{len(bad)} of {len(results)} failed: {bad[:3]}"
    assert c.registry.state()["outages"] >= 2


def retires_its_pair_once(marks_lost: bool = False):
    """A prefill worker whose pair with the decode worker is retired (as a send aborted on the
    wire retires it) just after the decode worker handed out the channel of the first
    request: the race a burst of client disconnects left behind. `marks_lost`: its dead-gen
    marks never reach the decode worker's store (as when that store cannot be reached under
    load), so only the cluster can move the receiver on. (A local class: Ray ships it by value.)"""

    class RetiresItsPairOnce(WorkerActor):
        async def target(self, request_id, target):
            conn = self.connector.local
            if marks_lost:
                conn.mark_dead = lambda *args, **kw: None
            if not getattr(self, "_retired", False):
                self._retired = True
                with conn._lock:
                    conn._dead_send_gen[target.peer] = max(conn._dead_send_gen.get(target.peer, -1),
                                                           target.channel.gen)
            await super().target(request_id, target)

    return RetiresItsPairOnce


@pytest.mark.parametrize("marks_lost", [False, True], ids=["marked", "marks-lost"])
def test_a_send_refused_on_a_retired_pair_is_retried_at_once_on_a_new_gen(tiny_models, marks_lost):
    """The send is refused at once (a stale channel); the request is retried at once, on a new
    gen of the pair, instead of waiting out the decode worker's 30 s receive deadline, and it
    answers what the same prompt answers afterwards. With the sender's dead-gen marks lost, the
    dispatcher has the receiver close its side before the retry: never three tries into the
    same retired gen (what a loaded host once answered with errors)."""
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, max_model_len=256,
                      worker_cls=retires_its_pair_once(marks_lost))
    server = Server(build_app(c))
    try:
        body = {"prompt": list(range(100, 150)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        t = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        took = time.monotonic() - t
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        # the bound is the code's: a retry that waited for the receive's deadline took longer
        assert took < HandoffConfig().timeout_s, f"{took:.1f} s: the attempt waited out the handoff deadline"
        assert c.counters["retries"] == 1
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert again["choices"][0]["text"] == r.json()["choices"][0]["text"]
        assert c.counters["retries"] == 1  # the pair's new gen carries the next one
    finally:
        server.stop()
        c.shutdown()


def slow_admit(max_tokens: int, wait_s: float):
    """A real worker that holds a request of `max_tokens` for `wait_s` before it starts it: load
    that a drain has to wait for, as long as the test needs."""

    class SlowAdmit(WorkerActor):
        async def _decode(self, call):
            if call.request.params.max_tokens == max_tokens:
                await asyncio.sleep(wait_s)
            return await super()._decode(call)

    return SlowAdmit


def test_a_member_lost_during_a_shrink_calls_off_the_drain_of_the_worker_still_needed(tiny_models):
    """`scale --decode 1` of 2: one worker drains (a request holds it), then the one meant to stay
    dies. Requests go to the draining worker at once (they were 503 "no healthy decode worker"
    until a replacement started), and the monitor takes it back into the pool instead of removing
    it: no replacement starts, the shrink's call returns."""
    held = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    c = Cluster.start(tiny_models["llama"], decode=2, mode="colocated", max_model_len=256,
                      worker_cls=slow_admit(held.max_tokens, 12.0))
    try:
        got: list[list] = []
        busy = []
        # held requests until each worker has one: placement may put two on one worker (the hash, or
        # a worker its probe found silent on a busy host is out of placement while the other answers)
        while not all(w.load for w in c.workers.values()):
            assert len(busy) < 30, "the held requests never reached both workers"
            got.append([])
            busy.append(c.submit(None, c.validate([40 + len(busy), 6, 7, 8], held), got[-1].append, stream=False))
            time.sleep(1.0)
        shrink = threading.Thread(target=c.scale, kwargs={"decode": 1})
        shrink.start()
        _wait(lambda: any(w.draining for w in c.workers.values()), 30, "no worker started draining")
        leaving = next(w.worker_id for w in c.workers.values() if w.draining)
        (staying,) = set(c.workers) - {leaving}
        ray.kill(c.workers[staying].actor)
        outs = c.generate([[9 + i, 6, 7, 8] for i in range(6)], GREEDY)
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 6, [o.outputs[0] for o in outs]
        assert {o.decode_worker for o in outs} == {leaving}
        _wait(lambda: staying not in c.workers and not c.workers[leaving].draining, 30, "the drain went on")
        shrink.join(60)
        assert not shrink.is_alive() and c.pool_sizes()["decode"] == 1
        for f in busy:
            f.result(120)
        assert [g[-1].outputs[0].finish_reason for g in got] == ["length"] * len(got)  # the killed worker's retried
        time.sleep(2.0)  # a pass of the monitor: no replacement starts, the taken-back worker stays
        assert list(c.workers) == [leaving] and c.pools.targets["decode"] == 1
    finally:
        c.shutdown()


def dies_after_three_tokens(flag: str):
    """A worker that ends its process once it has sent some request's third token;
    the first worker of the cluster to get there claims `flag` (a file), so only one dies."""

    class DiesAfterThreeTokens(WorkerActor):
        def _deliver(self, request_id, result=None, output=None, error=None):
            import os
            import time

            super()._deliver(request_id, result, output, error)  # on its way to the cluster (pipe or Ray)
            counts = self.__dict__.setdefault("counts", {})
            counts[request_id] = counts.get(request_id, 0) + len(output.delta_token_ids if output else [])
            if counts[request_id] >= 3:
                try:
                    os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return
                time.sleep(0.2)  # the tokens reach the cluster
                os._exit(1)

    return DiesAfterThreeTokens


def test_a_json_request_whose_worker_dies_after_its_first_tokens_is_retried_with_the_same_tokens(tiny_models,
                                                                                                   tmp_path):
    """The client of a JSON reply has seen nothing when its worker dies after three tokens: the
    request is retried on the other worker and, seeded, answers what it answers undisturbed."""
    c = Cluster.start(tiny_models["llama"], decode=2, mode="colocated", max_model_len=256,
                      worker_cls=dies_after_three_tokens(str(tmp_path / "died")))
    server = Server(build_app(c))
    try:
        body = {"prompt": list(range(100, 140)), "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert (tmp_path / "died").exists()
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert c.counters["retries"] == 1
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        assert again.json()["usage"]["completion_tokens"] == r.json()["usage"]["completion_tokens"] == 24
    finally:
        server.stop()
        c.shutdown()


def test_the_persisted_tier_is_saved_idle_on_its_interval_with_only_its_used_blocks(tiny_models, tmp_path):
    """An empty tier is saved as no blocks (not the whole host buffer); after a burst, an idle
    worker still saves on its interval, so a worker killed then (no graceful shutdown) is
    replaced by one that restores what the burst cached."""
    import json
    import os

    model = tiny_models["llama"]
    prompt = list(range(100, 200))  # 6 full blocks
    kw = dict(max_model_len=256, kv_offloading_size=0.001, kv_persist_dir=str(tmp_path), mode="colocated", decode=1,
              kv_persist_interval_s=1.0)

    def saved() -> tuple[list, list]:
        """The tier's index files and its block files under the directory."""
        files = [os.path.join(d, n) for d, _, names in os.walk(tmp_path) for n in names]
        return [f for f in files if f.endswith("host_tier.json")], [f for f in files if f.endswith(".kvb")]

    c = Cluster.start(model, **kw)
    try:
        # nothing cached: no block file; an index only if the interval (1 s) already came, naming no block
        # (it did on a busy host before this line ran: asserting "no index yet" was a race)
        index, blocks = saved()
        assert blocks == [] and all(json.load(open(f))["hashes"] == [] for f in index), (index, blocks)
        c.generate([prompt], GREEDY)
        (wid,) = c.workers
        _wait(lambda: saved()[0], 30, "an idle worker never saved its tier on the interval")
        (index,) = saved()[0]
        _wait(lambda: len(json.load(open(index))["hashes"]) >= 6, 30, "the burst's blocks never saved")
        assert len(saved()[1]) <= len(json.load(open(index))["hashes"]) + 4  # used blocks only
        ray.kill(ray.get_actor(wid, namespace="pdserve"))  # a crash: no save at shutdown
        _wait(lambda: c.pool_sizes()["decode"] == 1 and wid not in c.workers, 120, "never replaced")
        (row,) = c.status()
        assert row["kv_persist_status"].startswith("restored ") and "refused" not in row["kv_persist_status"]
        assert c.generate([prompt], GREEDY)[0].num_cached_tokens == 96
    finally:
        c.shutdown()


def slow_stop():
    """A real worker whose graceful stop takes 60 s: the window in which a removal (a drain's)
    is under way when the cluster shuts down."""

    class SlowStop(WorkerActor):
        async def stop(self):
            await asyncio.sleep(60)
            await super().stop()

    return SlowStop


def test_a_removal_cut_short_by_shutdown_leaves_no_actor_and_a_stray_worker_joins_no_other_cluster(tiny_models):
    from pdserve.cluster.registry.registry import REGISTRY_NAME, Membership

    c = Cluster.start(tiny_models["llama"], prefill=1, decode=2, max_model_len=256, worker_cls=slow_stop())
    try:
        threading.Thread(target=lambda: c.scale(decode=1, timeout=30), daemon=True).start()
        deadline = time.monotonic() + 60
        while not c.pools.leaving and time.monotonic() < deadline:
            time.sleep(0.1)
        (leaving,) = list(c.pools.leaving)  # out of placement, its stop under way
        old_cluster = c.registry.cluster_id
    finally:
        c.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(leaving, namespace="pdserve")
        except ValueError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"{leaving} outlived its cluster's shutdown")

    # a worker that outlived its cluster anyway finds the next cluster's registry by name: refused
    c = Cluster.start(tiny_models["llama"], prefill=1, decode=1, max_model_len=256)
    try:
        assert ray.get_actor(REGISTRY_NAME, namespace="pdserve") is not None
        stray = Membership("stray-worker", "pdserve", old_cluster)
        asyncio.run(stray.join(c.pools.workers[next(iter(c.pools.workers))].info))
        assert stray.orphaned
        assert "stray-worker" not in {w.worker_id for w in c.registry_workers()}
        assert len(c.registry_workers()) == 2
    finally:
        c.shutdown()
