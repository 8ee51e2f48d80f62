"""The prefill:decode ratio planner (cluster/pools/ratio.py): the load it measures from finished
requests and the workers' own measures, the split it asks for, when it moves; the step
model's decode capacity it reads; then a real local Ray cluster whose pools follow a
prompt-heavy load from 1:2 to 2:1 without losing a request."""

from __future__ import annotations

import time

import pytest

from pdserve import SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.pools.ratio import LOOK_S, MAX_CORRECTION, Arrived, Finished, RatioLoad, RatioPlanner
from pdserve.cluster.records import WorkerStats
from pdserve.cluster.spec.serving_config import ServingConfig, SloConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.decode_capacity import DecodeCapacity
from pdserve.engine.core.scheduler import StepShape
from pdserve.engine.core.step_model import StepModel

from helpers import PROMPTS

PREFILL = WorkerStats(prefill_tok_s=10000.0)
SPEC = EngineConfig(max_num_seqs=256, block_size=16)  # the decode pool's spec: what the cluster set


def decode_stats(at_target=None, blocks=100000):
    return WorkerStats(decode_capacity=DecodeCapacity.of(at_target or {}), kv_blocks_total=blocks)


def window(planner: RatioPlanner, now: float, n: int, prompt: int, out: int, decode_s: float, span: float = 20.0,
           ttft_s: float | None = None, arrived: int | None = None):
    """`n` requests finished over the last `span` seconds, and as many arrived (or `arrived`)."""
    planner.since = now - span
    for i in range(n):  # spread over the last `span` seconds
        planner.finished.append(Finished(now - span + span * (i + 1) / n, prompt, out, decode_s, ttft_s))
    planner.arrived.clear()
    m = n if arrived is None else arrived
    planner.arrived.extend(Arrived(now - span + span * i / m, prompt) for i in range(m))


def test_the_split_follows_the_load():
    # 2 prompts/s of 4000 tokens: 8000 tok/s = 1.0 prefill worker at 80%; 4 decoding of 64: ~0.07 worker
    load = RatioLoad(8000.0, 4.0, 10000.0, 64.0, 40)
    assert load.split(4, 1, 1) == 3.0  # bounded: one decode worker stays
    heavy_decode = RatioLoad(800.0, 200.0, 10000.0, 64.0, 40)  # 0.1 prefill vs 3.5 decode workers
    assert heavy_decode.split(4, 1, 1) == 1.0
    even = RatioLoad(8000.0, 57.6, 10000.0, 64.0, 40)  # 1.0 and 1.0
    assert even.split(4, 1, 1) == pytest.approx(2.0)


def test_decode_capacity_is_read_at_the_workloads_context_and_bounded_by_kv():
    assert DecodeCapacity.of({512: 128, 2048: 64, 8192: 16}).at(1280) == pytest.approx(96.0)
    assert DecodeCapacity.of({512: 128, 8192: 16}).at(100) == 128 and DecodeCapacity.of({512: 128}).at(9000) == 128
    assert DecodeCapacity().at(1000) is None
    p = RatioPlanner(window_s=30, cooldown_s=0)
    now = time.monotonic()
    window(p, now, 40, 1000, 200, 4.0)  # 2 req/s, each decoding 4 s: 8 at once
    load = p.measure([PREFILL], [decode_stats({512: 128, 2048: 64})], now, SPEC)
    assert load.prefill_tok_s == pytest.approx(2000.0) and load.decoding == pytest.approx(8.0)
    assert load.decode_seqs == pytest.approx(128 - 64 * (1100 - 512) / 1536)  # at 1000 + 200 / 2 tokens
    # a worker whose KV holds 1200 x 20 tokens: 20 sequences, whatever its step model says
    assert p.measure([PREFILL], [decode_stats({512: 128}, blocks=1500)], now, SPEC).decode_seqs == pytest.approx(20)
    # no step-model capacity yet: max_num_seqs, within the KV
    assert p.measure([PREFILL], [decode_stats()], now, SPEC).decode_seqs == 256
    assert p.measure([WorkerStats(prefill_tok_s=None)], [decode_stats()], now, SPEC) is None  # no rate measured yet
    few = RatioPlanner(window_s=30, cooldown_s=0)
    window(few, now, 10, 1000, 200, 4.0)
    assert few.measure([PREFILL], [decode_stats()], now, SPEC) is None  # too few to measure


def test_the_load_is_what_arrives_a_drained_backlog_is_not_new_load():
    """40 requests finish in 20 s while 20 arrive (a starved prefill pool's queue clearing after a
    move): the load is the arrivals' 1 req/s, priced by the finished requests' sizes and decode
    times; counted by their ends it would read twice that (how the planner once overshot)."""
    now = 1000.0
    p = RatioPlanner(window_s=30, cooldown_s=0, clock=lambda: now)
    window(p, now, 40, 1000, 200, 4.0, arrived=20)
    load = p.measure([PREFILL], [decode_stats({512: 128})], now, SPEC)
    assert load.prefill_tok_s == pytest.approx(1000.0) and load.decoding == pytest.approx(4.0)
    # the edge's calls: each arrival once, on the planner's clock; nothing finished yet: no plan
    q = RatioPlanner(window_s=30, cooldown_s=0, clock=lambda: now)
    for _ in range(3):
        q.on_arrive(500, 64)
    assert q.since == now and list(q.arrived) == [Arrived(now, 500, 64)] * 3
    assert q.measure([PREFILL], [decode_stats()], now, SPEC) is None


def test_the_decode_load_counts_the_long_requests_that_have_not_finished_yet():
    """The window's first look after the traffic starts: 40 requests arrived over 20 s, half
    asking for 20 tokens and half for 380, and only the short ones have finished (20 tokens each,
    19 after the first in 0.38 s: 20 ms a token). Every request decodes 199 tokens after its first
    on average, 3.98 s: 2 req/s x 3.98 s = 7.96 decoding. The finished requests' own mean decode
    time (0.38 s) read 0.76, ten times too few, and moved the split to prefill. Requests that stop
    before their max_tokens count the share the finished ones used; without max_tokens, the
    finished requests' mean stands."""
    now = 1000.0
    p = RatioPlanner(window_s=30, cooldown_s=0, clock=lambda: now)
    p.since = now - 20
    p.arrived.extend(Arrived(now - 20 + i / 2, 1000, 20 if i % 2 else 380) for i in range(40))
    p.finished.extend(Finished(now - 19 + i, 1000, 20, 0.38, 0.2, 20) for i in range(20))
    load = p.measure([PREFILL], [decode_stats({512: 128})], now, SPEC)
    assert load.prefill_tok_s == pytest.approx(2000.0) and load.decoding == pytest.approx(2 * 199 * 0.02)
    assert load.decode_seqs == pytest.approx(128)  # at 1000 + 200 / 2 tokens: past the table's last context
    p.finished = type(p.finished)(Finished(r.t, r.prompt, 10, 0.18, 0.2, 20) for r in p.finished)  # EOS at half
    assert p.measure([PREFILL], [decode_stats({512: 128})], now, SPEC).decoding == pytest.approx(2 * 99 * 0.02)
    p.arrived = type(p.arrived)(a._replace(max_tokens=None) for a in p.arrived)
    assert p.measure([PREFILL], [decode_stats({512: 128})], now, SPEC).decoding == pytest.approx(2 * 0.18)


def test_the_planner_moves_after_two_looks_goes_on_the_same_way_and_cools_down_before_turning():
    p = RatioPlanner(window_s=30, cooldown_s=60)
    bounds = {"prefill": (1, 8), "decode": (1, 8)}
    load = RatioLoad(30000.0, 4.0, 10000.0, 64.0, 40)  # prompt-heavy: 7 of 8 should prefill (the bound)
    sizes = {"prefill": 2, "decode": 6}
    assert p.want(load, sizes, bounds, 0.0) is None  # the first look only leans
    assert p.want(load, sizes, bounds, LOOK_S / 2) is None  # not another look yet
    want, why = p.want(load, sizes, bounds, LOOK_S)
    assert want == {"prefill": 4, "decode": 4} and why.startswith("ratio: 7.00 of 8 workers should prefill")
    sizes = want  # half the gap; the same way goes on within the cooldown, after two looks again
    assert p.want(load, sizes, bounds, LOOK_S * 2) is None
    want, _ = p.want(load, sizes, bounds, LOOK_S * 3)
    assert want == {"prefill": 6, "decode": 2}
    sizes = want
    # within the cooldown the window's latencies still hold the misses from before the moves: the
    # live correction does not push further (6.26 of 8 without it, 7 with it)
    near = RatioLoad(2000.0, 4.0, 10000.0, 64.0, 40, prefill_correction=2.0)
    assert near.split(8, 1, 1) == 7.0 and near.uncorrected().split(8, 1, 1) == pytest.approx(6.26, abs=0.01)
    assert all(p.want(near, sizes, bounds, t * LOOK_S) is None for t in range(4, 10))
    # the other way waits out the cooldown (60 s from the last move)
    moved = LOOK_S * 3
    light = RatioLoad(5000.0, 40.0, 10000.0, 64.0, 40)  # decode-heavy: 3.79 of 8
    assert all(p.want(light, sizes, bounds, moved + t) is None for t in (LOOK_S * 7, 30.0, 50.0, 59.0, 59.5))
    assert p.want(light, sizes, bounds, moved + 61.0) is None  # a first look
    assert p.want(light, sizes, bounds, moved + 61.0 + LOOK_S)[0] == {"prefill": 5, "decode": 3}
    bounds = {"prefill": (1, 4), "decode": (1, 4)}
    load = RatioLoad(20000.0, 4.0, 10000.0, 64.0, 40)  # prompt-heavy: 3 of 4 should prefill
    # within the hysteresis, nothing moves; the bounds hold
    near = RatioLoad(12000.0, 57.6, 10000.0, 64.0, 40)  # 2.4 of 4
    q = RatioPlanner(window_s=30, cooldown_s=0)
    assert all(q.want(near, {"prefill": 2, "decode": 2}, bounds, t * LOOK_S) is None for t in range(4))
    assert all(q.want(load, {"prefill": 3, "decode": 1}, bounds, t * LOOK_S) is None for t in range(4))
    assert all(q.want(load, {"prefill": 2, "decode": 2}, {"prefill": (1, 2), "decode": (1, 4)}, t * LOOK_S) is None
               for t in range(10, 14))


def test_while_workers_switch_the_planner_goes_on_the_same_way_counting_them_where_they_go():
    """A move still draining (workers `switching_to` the other pool) does not hold the next move
    the same way: the switching workers count in the pool they go to, and after two looks the rest
    of the gap follows. The other way waits; a worker draining out of the cluster holds all."""
    from pdserve.cluster.records import WorkerRecord

    p = RatioPlanner(window_s=30, cooldown_s=60)
    serving = ServingConfig(slo=SloConfig(2.0, 0.05))
    for r in ("prefill", "decode"):
        serving.pool(r).min, serving.pool(r).max = 1, 7
    workers = [WorkerRecord(f"p{i}", "prefill", None, stats=PREFILL) for i in range(2)]
    workers += [WorkerRecord(f"d{i}", "decode", None, stats=decode_stats({1024: 64})) for i in range(6)]
    window(p, 100.0, 40, 3000, 16, 0.5, arrived=100)  # prompt-heavy: 7 of 8 should prefill (the bound)
    assert p.plan(workers, serving, SPEC, 100.0) is None  # the first look leans
    want, _ = p.plan(workers, serving, SPEC, 100.0 + LOOK_S)
    assert want == {"prefill": 4, "decode": 4}  # half the gap
    for w in workers[2:4]:
        w.switching_to = "prefill"  # still draining their decodes
    assert p.plan(workers, serving, SPEC, 100.0 + 2 * LOOK_S) is None  # two looks again
    want, _ = p.plan(workers, serving, SPEC, 100.0 + 3 * LOOK_S)
    assert want == {"prefill": 6, "decode": 2}  # from 4:4 as they will be, not 2:6 as they are
    for w in workers[4:6]:
        w.switching_to = "prefill"
    light = RatioPlanner(window_s=30, cooldown_s=0)  # decode-heavy now, and no cooldown: still no turn
    light.last_way, light.last_move = 1, 100.0
    window(light, 200.0, 40, 100, 400, 20.0, arrived=100)
    assert all(light.plan(workers, serving, SPEC, 200.0 + t * LOOK_S) is None for t in range(4))
    for w in workers[2:6]:  # switched
        w.role, w.switching_to = "prefill", None
    assert light.plan(workers, serving, SPEC, 200.0 + 4 * LOOK_S) is None  # a first look the other way
    assert light.plan(workers, serving, SPEC, 200.0 + 5 * LOOK_S)[0]["decode"] > 2
    workers[0].draining = True  # a shrink: nothing planned
    assert all(light.plan(workers, serving, SPEC, 200.0 + t * LOOK_S) is None for t in range(6, 9))


def test_the_prefill_load_leaves_out_what_a_prefix_cache_held():
    """A quarter of the finished requests' prompt tokens came from a prefix cache: the prefill
    pool computes three quarters of what arrives (on the Mooncake trace the whole prompt counted
    read 12 of 16 workers to prefill where 11 served most)."""
    now = 1000.0
    p = RatioPlanner(window_s=30, cooldown_s=0, clock=lambda: now)
    p.since = now - 20
    p.arrived.extend(Arrived(now - 20 + i / 2, 1000, 200) for i in range(40))
    p.finished.extend(Finished(now - 19 + i, 1000, 200, 3.98, 0.2, 200, 250) for i in range(20))
    load = p.measure([PREFILL], [decode_stats({512: 128})], now, SPEC)
    assert load.prefill_tok_s == pytest.approx(2000.0 * 0.75)


def test_a_window_not_yet_full_needs_a_wider_gap_to_move():
    """Six seconds into the traffic the split must pass the pools' sizes by 0.5 + 0.2 x
    sqrt(30 / 6) = 0.95 workers to count, not 0.7: a 16-worker cluster at its best split, 11:5,
    read 11.73 on its first looks (a cold prefix cache, only short requests finished) and moved a
    worker off it. After 30 s (SETTLE_S, or the window if shorter) the usual 0.7 holds, whatever
    the window; a cluster far off its split moves at once either way."""
    now = 1000.0
    bounds = {"prefill": (1, 15), "decode": (1, 15)}
    near = RatioLoad(11.73 * 8000.0, 4.27 * 57.6, 10000.0, 64.0, 40)  # 11.73 of 16
    assert near.split(16, 1, 1) == pytest.approx(11.73)
    early = RatioPlanner(window_s=30, cooldown_s=0)
    early.since = now - 6
    assert all(early.want(near, {"prefill": 11, "decode": 5}, bounds, now + t * LOOK_S) is None for t in range(2))
    full = RatioPlanner(window_s=120, cooldown_s=0)
    full.since = now - 30
    assert full.want(near, {"prefill": 11, "decode": 5}, bounds, now) is None  # leans
    assert full.want(near, {"prefill": 11, "decode": 5}, bounds, now + LOOK_S)[0] == {"prefill": 12, "decode": 4}
    far = RatioPlanner(window_s=30, cooldown_s=0)
    far.since = now - 1  # 0.5 + 0.2 x sqrt(30) = 1.6
    assert far.want(near, {"prefill": 8, "decode": 8}, bounds, now) is None
    assert far.want(near, {"prefill": 8, "decode": 8}, bounds, now + LOOK_S)[0] == {"prefill": 10, "decode": 6}


def test_the_live_correction_leans_to_the_side_that_misses_its_target_and_a_big_cluster_moves_half_the_gap():
    """The window's p90 TTFT or TPOT over the SLO's target multiplies that side's load (up to
    MAX_CORRECTION); where both meet their targets the models' estimate stands. 64 workers 8 off
    the split move 4 at once; 4 workers move one."""
    slo = SloConfig(ttft_s=2.0, tpot_s=0.04)
    now = 1000.0
    p = RatioPlanner(window_s=30, cooldown_s=0, clock=lambda: now)
    window(p, now, 40, 1000, 101, 2.0, ttft_s=0.5)  # TPOT 20 ms, TTFT 0.5 s: both met
    met = p.measure([PREFILL], [decode_stats({1000: 64})], now, SPEC, slo)
    assert (met.prefill_correction, met.decode_correction) == (1.0, 1.0)
    p.finished.clear()
    window(p, now, 40, 1000, 101, 6.0, ttft_s=0.5)  # TPOT 60 ms: 1.5x its target
    slow = p.measure([PREFILL], [decode_stats({1000: 64})], now, SPEC, slo)
    assert slow.decode_correction == pytest.approx(1.5) and slow.prefill_correction == 1.0
    # decode leans: fewer prefill workers than the same load uncorrected
    assert slow.split(8, 1, 1) < RatioLoad(slow.prefill_tok_s, slow.decoding, slow.prefill_rate, slow.decode_seqs,
                                           40).split(8, 1, 1)
    p.finished.clear()
    window(p, now, 40, 1000, 101, 2.0, ttft_s=9.0)  # TTFT 4.5x its target: capped
    late = p.measure([PREFILL], [decode_stats({1000: 64})], now, SPEC, slo)
    assert late.prefill_correction == MAX_CORRECTION and "prefill x2.00" in late.describe()
    assert p.measure([PREFILL], [decode_stats({1000: 64})], now, SPEC).prefill_correction == 1.0  # no SLO given
    # the move: half the gap, at least one worker
    big = RatioPlanner(window_s=30, cooldown_s=0)
    load = RatioLoad(40 * 8000.0, 24 * 57.6, 10000.0, 64.0, 40)  # 40 of 64 should prefill
    bounds = {"prefill": (1, 63), "decode": (1, 63)}
    assert big.want(load, {"prefill": 32, "decode": 32}, bounds, 0.0) is None
    assert big.want(load, {"prefill": 32, "decode": 32}, bounds, LOOK_S)[0] == {"prefill": 36, "decode": 28}


def test_the_live_correction_takes_no_worker_from_a_side_its_own_load_leaves_short():
    """Both sides short of what their loads need (an overloaded cluster, or one whose window still
    holds the TTFTs of a backlog): a move that only the correction asks for would trade one side's
    misses for the other's, so it waits. Where the giving side has room, or the load alone asks
    for the move, it goes."""
    bounds = {"prefill": (1, 15), "decode": (1, 15)}
    # 13.6 prefill and 5.6 decode workers' worth of load on 16 (11:5): 11.3 uncorrected, 11.8 with
    # the TTFT correction (x1.15); 12:4 would leave decode with 4 for 5.6 workers' load
    short = RatioLoad(13.6 * 8000.0, 5.63 * 57.6, 10000.0, 64.0, 40, prefill_correction=1.15)
    assert short.uncorrected().split(16, 1, 1) == pytest.approx(11.32, abs=0.01)
    assert short.split(16, 1, 1) == pytest.approx(11.76, abs=0.01)
    p = RatioPlanner(window_s=30, cooldown_s=0)
    p.since = -100.0  # past the first seconds' wider gap
    assert all(p.want(short, {"prefill": 11, "decode": 5}, bounds, t * LOOK_S) is None for t in range(4))
    # decode has room (4 workers' load on 5, 10.5 prefill workers' on 11): the correction moves one
    roomy = RatioLoad(10.5 * 8000.0, 4.0 * 57.6, 10000.0, 64.0, 40, prefill_correction=1.5)
    q = RatioPlanner(window_s=30, cooldown_s=0)
    q.since = -100.0
    assert roomy.uncorrected().split(16, 1, 1) < 11.7 < roomy.split(16, 1, 1)
    assert q.want(roomy, {"prefill": 11, "decode": 5}, bounds, 0.0) is None
    assert q.want(roomy, {"prefill": 11, "decode": 5}, bounds, LOOK_S)[0] == {"prefill": 12, "decode": 4}
    # the load alone asks for it: it goes, short or not
    r = RatioPlanner(window_s=30, cooldown_s=0)
    r.since = -100.0
    heavy = RatioLoad(16.0 * 8000.0, 5.63 * 57.6, 10000.0, 64.0, 40, prefill_correction=1.15)
    assert r.want(heavy, {"prefill": 10, "decode": 6}, bounds, 0.0) is None
    assert r.want(heavy, {"prefill": 10, "decode": 6}, bounds, LOOK_S)[0]["prefill"] == 11


def test_the_step_model_says_how_many_decodes_fit_the_target():
    m = StepModel(2048, slo_tpot_s=0.05, margin=0.8)  # 40 ms a step
    for b in (1, 2, 4, 8, 16, 32, 64, 128):  # 10 ms + 0.2 ms a row + 1 us a context token
        for ctx in (500, 1000, 3000):
            m.observe(StepShape(decodes=b, kv_tokens=b * ctx), 0.010 + 0.0002 * b + 1e-6 * b * ctx)
    m._fit()
    # 0.010 + b x (0.0002 + 0.0009) <= 0.040: b <= 27 at 900 tokens of context
    assert m.decode_capacity(900, 256) == 27
    assert m.decode_capacity(900, 16) == 16  # max_num_seqs bounds it
    table = m.capacity_table(4096, 256)
    assert table.points == ((512, 42), (2048, 13), (4096, 6))
    # and the step of that many decodes at each: the time a token takes at the batch planned on
    assert [c for c, _ in table.steps] == [512, 2048, 4096]
    for (c, n), (_, t) in zip(table.points, table.steps):
        assert t == pytest.approx(0.010 + n * (0.0002 + 1e-6 * c))
    assert table.step_at(1280) == pytest.approx((table.steps[0][1] + table.steps[1][1]) / 2)
    assert StepModel(2048).capacity_table(4096, 256) == DecodeCapacity()  # not fitted: nothing to say
    # without a target: no sequences at it, and the step of max_num_seqs decodes
    free = StepModel(2048)
    free.coef, free.slo_tpot_s = m.coef, None
    untargeted = free.capacity_table(4096, 64)
    assert untargeted.points == () and untargeted.at(1000) is None
    assert untargeted.step_at(2048) == pytest.approx(0.010 + 64 * (0.0002 + 1e-6 * 2048))


def test_the_time_a_token_takes_is_the_decode_workers_step_at_the_batch_planned_on():
    """The finished requests of a window that starts with the traffic decoded in small batches
    (here 5 ms a token); the decode pool is planned at its capacity, whose step its step model
    says (25 ms): Little's law counts the sequences at that pace, five times as many."""
    now = 1000.0
    p = RatioPlanner(window_s=30, cooldown_s=0, clock=lambda: now)
    window(p, now, 40, 1000, 201, 1.0)  # 2 req/s, 200 tokens after the first at 5 ms
    light = p.measure([PREFILL], [decode_stats({512: 128})], now, SPEC)
    assert light.decoding == pytest.approx(2 * 200 * 0.005)  # no step model yet: what the requests got
    fitted = WorkerStats(decode_capacity=DecodeCapacity.of({512: 128}, {512: 0.025}), kv_blocks_total=100000)
    assert p.measure([PREFILL], [fitted], now, SPEC).decoding == pytest.approx(2 * 200 * 0.025)


# ---- a real cluster -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_prompt_heavy_load_moves_a_decode_worker_to_prefill(shared_ray):
    cfg = ServingConfig.from_dict({"autoscale": {"enabled": True, "policy": "ratio", "cooldown_s": 1.0,
                                                 "window_s": 120.0}, "decode": {"replicas": 2}})
    c = Cluster.start(mode="disaggregated", prefill=1, serving_config=cfg, max_model_len=512)
    try:
        before = set(c.workers)
        prompts = [p + " " + "lorem ipsum dolor sit amet " * 30 for p in PROMPTS]  # ~300 tokens, 2 out
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        first = [o.outputs[0].token_ids for o in c.generate(prompts * 3, params)]
        # the edge tells the planner what a prefix cache held of each prompt (each came three times)
        assert any(r.cached >= 16 for r in c.pools.ratio.finished), list(c.pools.ratio.finished)[:3]
        deadline = time.monotonic() + 90
        while c.pool_sizes() != {"prefill": 2, "decode": 1} and time.monotonic() < deadline:
            c.generate(prompts[:4], params)  # traffic goes on while it moves
        assert c.pool_sizes() == {"prefill": 2, "decode": 1}, c.counters["autoscale"]
        assert set(c.workers) == before  # moved, not started or stopped
        plan = c.snapshot().autoscale_plan  # what /admin/status shows of its last look
        assert plan["of"] == 3 and "tok/s" in plan["load"], plan
        event = c.counters["autoscale"][-1]
        assert event["role"] == "ratio" and " of 3 workers should prefill" in event["reason"], event
        assert float(event["reason"].split()[1]) > 1.7, event  # past the hysteresis from 1 (at most 2)
        again = [o.outputs[0].token_ids for o in c.generate(prompts * 3, params)]
        assert again == first  # nothing lost or changed across the move
    finally:
        c.shutdown()
