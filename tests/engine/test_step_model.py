"""The step-time model (engine/core/step_model.py) on its own: the fit recovers a known cost,
chunks wait for the banked slack, the TPOT target bounds what a step carries; then a real
engine under a TPOT target keeps its decodes' mean step inside it while it prefills."""

from __future__ import annotations

import random
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.core.scheduler import ScheduledRequest, StepShape
from pdserve.engine.core.step_model import MIN_CHUNK, PROBE_TOKENS, StepModel


class R:  # the three fields the model reads of a request
    def __init__(self, num_tokens: int, computed: int, outputs: int):
        self.num_tokens, self.num_computed_tokens, self.num_output_tokens = num_tokens, computed, outputs

    @property
    def is_decoding(self) -> bool:
        return self.num_tokens - self.num_computed_tokens == 1 and self.num_output_tokens > 0


def step(decodes: int, chunk: int) -> list[ScheduledRequest]:
    out = [ScheduledRequest(R(1001, 1000, 5), 1, []) for _ in range(decodes)]
    if chunk:
        out.append(ScheduledRequest(R(9000, 0, 0), chunk, []))
    return out


def cost(decodes: int, chunk: int) -> float:
    """A GPU-like step: 8 ms + 0.05 ms per decode, +20 ms for any prefill, 30 us per prefill token."""
    return 0.008 + 0.00005 * decodes + (0.020 + 30e-6 * chunk if chunk else 0.0)


def fitted(slo: float) -> StepModel:
    m = StepModel(8192, slo)
    rng = random.Random(0)
    for _ in range(300):
        d, c = rng.randrange(1, 64), rng.choice((0, 0, 256, 512, 1024, 2048))
        m.observe(StepShape.of(step(d, c)), cost(d, c))
    m._fit()
    return m


def test_a_timed_block_is_learnt_as_the_shape_it_is_given_and_none_restarts_the_clock():
    """An overlapped launch on CUDA only queues its step and waits for the one in flight: the engine
    times the block as that step's shape (engine._launch). With nothing in flight (None) the clock
    restarts and nothing is learnt; the next block's time runs from there."""
    m = StepModel(8192, 0.02)
    with m.timed(None):
        time.sleep(0.005)
    assert not m.decode_steps and not m.mixed_steps
    mixed = StepShape.of(step(4, 1024))
    with m.timed(mixed):
        time.sleep(0.03)
    (shape, seconds), = m.mixed_steps
    assert shape[:2] == (4, 1024) and 0.03 <= seconds < 0.2 and not m.decode_steps


def test_fit_recovers_the_cost():
    m = fitted(0.04)
    for d, c in ((1, 0), (32, 0), (32, 512), (60, 2048)):
        assert m.predict(d, c, 1001 * d, c * c / 2) == pytest.approx(cost(d, c), rel=0.02)


def test_chunk_fits_target_plus_full_bank():
    m = fitted(0.04)
    target = m.margin * 0.04
    n = m.chunk_at(32, 32 * 1001)
    assert cost(32, n) == pytest.approx(4 * target, rel=0.02)  # the step may take (1 + BANK_STEPS) x target
    assert fitted(0.02).chunk_at(32, 32 * 1001) < n  # a tighter target, a smaller chunk
    assert m.chunk_at(0, 0) == 8192  # nothing decoding: the step budget


def test_chunks_wait_for_the_bank():
    m = fitted(0.04)
    want = m.chunk_at(32, 32 * 1001)
    assert m.chunk_for(32, 32 * 1001, 0, slack=0.0, remaining=8000) == 0  # not yet affordable
    assert m.chunk_for(32, 32 * 1001, 0, slack=1.0, remaining=8000) == want  # capped at the full bank
    short = m.chunk_for(32, 32 * 1001, 0, slack=0.05, remaining=300)  # the prompt's rest fits now
    assert short == 300 >= MIN_CHUNK


def test_no_target_no_cap():
    m = StepModel(2048, None)
    assert m.prefill_cap([R(11, 10, 1)], [R(500, 0, 0)]) is None


@pytest.mark.slow
def test_engine_keeps_mean_step_inside_target():
    """A real engine: decodes running while long prompts arrive. Every step that ran decodes
    carried at most the chunk the model allowed, and their mean wall time (as the engine
    measured it) stays inside the target while the prompts still got prefilled."""
    llm = LLM(max_model_len=2048, max_num_batched_tokens=2048)
    e = llm.engine
    rng = random.Random(0)
    decode = SamplingParams(max_tokens=80, ignore_eos=True, temperature=0)
    for _ in range(6):
        e.add_request([rng.randrange(100, 20000) for _ in range(24)], decode)
    for _ in range(12):  # the decode-only step time on this machine
        e.step()
    t_dec = e.step_model.step_s
    e.retune(3 * t_dec / e.step_model.margin)  # room for prefill beside the decodes
    for _ in range(2):
        e.add_request([rng.randrange(100, 20000) for _ in range(700)], SamplingParams(max_tokens=2, temperature=0))
    rows = []
    while e.has_unfinished_requests():
        e.step()
        rows.append(dict(e.step_model.last))
    with_decodes = [r for r in rows if r["decodes"]]
    assert any(r["prefill_tokens"] for r in with_decodes)  # prompts were prefilled beside the decodes
    for r in with_decodes:
        assert r["cap"] is None or r["prefill_tokens"] <= r["cap"]
    mean = sum(r["seconds"] for r in with_decodes) / len(with_decodes)
    assert mean <= e.step_model.margin * e.step_model.slo_tpot_s * 1.15, (mean, e.step_model.slo_tpot_s)


def test_a_prompt_progresses_when_the_decodes_alone_take_the_target_and_the_bank():
    """Decodes whose step alone leaves no chunk under target + a full bank: the prompt still
    gets a MIN_CHUNK step each time the bank is full (it starved before: TTFT 41 s seen)."""
    m = fitted(0.008)  # target 6.8 ms; a 32-decode step takes 9.6 ms, any mixed step > 28 ms
    target = m.margin * 0.008
    assert m.chunk_at(32, 32 * 1001) == 0 and m.rate_at(32, 32 * 1001) == 0.0  # placement sends no more
    running = [R(1001, 1000, 5) for _ in range(32)]
    waiting = [R(3000, 0, 0)]
    m.slack = 0.0
    for n in range(1, 200):  # noqa: B007 - n is read after the loop
        cap = m.prefill_cap(running, waiting)
        if cap:
            break
        m.observe(StepShape.of(step(32, 0)), cost(32, 0))
    assert cap == MIN_CHUNK and m.slack >= 3 * target - 1e-9
    assert n <= 3 / 0.05 + 2  # the bank fills at MIN_ROOM of the target per decode step


def test_chunks_without_a_fixed_cost_run_every_step():
    """Mixed steps in piecewise CUDA graphs: no fixed cost, and the bench's chunks all come
    from one prompt, so the fit may put the whole prefill cost on the attention term
    (per_token 0). The chunk is still the exact largest that fits, and it runs now instead
    of waiting for the bank (the fixed-point solve it replaced returned 0 here)."""
    def graph_cost(d: int, c: int, ctx: int) -> float:
        return 0.008 + 0.00005 * d + 4e-9 * c * (ctx + c / 2)

    m = StepModel(8192, 0.04)
    rng = random.Random(0)
    for _ in range(300):
        d, c = rng.randrange(1, 64), rng.choice((0, 0, 256, 512, 1024, 2048))
        ctx = 2 * c  # collinear with c: the fit cannot tell per-token from attention cost
        m.observe(StepShape.of([ScheduledRequest(R(1001, 1000, 5), 1, []) for _ in range(d)]
                               + ([ScheduledRequest(R(9000, ctx, 0), c, [])] if c else [])), graph_cost(d, c, ctx))
    m._fit()
    target = m.margin * 0.04
    assert m.coef[1] < 0.1 * target
    n = m.chunk_at(32, 32 * 1001)
    assert graph_cost(32, n, 0) == pytest.approx(4 * target, rel=0.05)
    now = m.chunk_for(32, 32 * 1001, 4096, slack=0.0, remaining=8000)
    assert now > 0 and graph_cost(32, now, 4096) == pytest.approx(target, rel=0.05)


def test_the_decode_graph_table_carries_what_is_not_linear_in_rows():
    """A decode worker (no prefill yet) with the runner's start-up table of its decode graphs:
    steps that turn compute-bound past 32 rows. The fit of measured steps (the table's time +
    2 ms of host work + the KV read) predicts sizes it has not seen within 2%, which a line in
    the rows cannot; the spec off-switch reads that same prediction, and no chunk is offered
    until steps with prefill are fitted."""
    table = {b: 0.008 + (0.0 if b <= 32 else 0.0004 * (b - 32)) for b in (1, 2, 4, 8, 16, 32, 64, 128)}
    truth = lambda b, kv: table[b] + 0.002 + 2e-8 * kv  # noqa: E731
    m, rng = StepModel(8192, 0.05, graphs=table), random.Random(0)
    for _ in range(64):
        b = rng.choice((1, 4, 16, 128))
        kv = b * rng.randrange(500, 4000)
        m.observe(StepShape(decodes=b, kv_tokens=kv), truth(b, kv))
    for b in (2, 8, 32, 64):
        assert m.decode_seconds(b, b * 2000) == pytest.approx(truth(b, b * 2000), rel=0.02), b
    lines = StepModel(8192, 0.05)  # no table: a line in the rows misses the turn
    for shape, seconds in m.decode_steps:
        lines.observe(StepShape(decodes=shape[0], kv_tokens=shape[2]), seconds)
    assert abs(lines.predict(64, 0, 64 * 2000, 0) / truth(64, 64 * 2000) - 1) > 0.05
    assert m.decode_seconds(200, 0) is None  # beyond the largest graph
    assert not m.prefill_fitted and m.chunk_at(16, 16 * 1000) == PROBE_TOKENS


def test_the_margin_follows_the_finished_requests_p90_tpot():
    """The SLO counts each request's TPOT: a p90 over 0.95 x target lowers the margin (smaller
    chunks beside the decodes, a lower advertised prefill rate); a p90 well under it lets the
    margin back up, never past where it started."""
    m = fitted(0.02)
    chunk, rate = m.chunk_at(32, 32 * 1001), m.rate_at(32, 32 * 1001)
    for _ in range(15):
        m.observe_tpot(0.024)
    assert m.margin == 0.85 and not m.tpot_over  # fewer than 16 requests: nothing to read yet
    m.observe_tpot(0.024)
    assert m.margin == pytest.approx(0.85 * 0.8)  # p90 24 ms vs 19 ms: lowered, by a fifth at most
    assert m.tpot_over  # and hybrid placement lends it no prompt until it is back
    assert m.chunk_at(32, 32 * 1001) < chunk and m.rate_at(32, 32 * 1001) < rate
    for _ in range(16):
        m.observe_tpot(0.0195)  # just over 0.95 x 20 ms: lowered in proportion
    assert m.margin == pytest.approx(0.85 * 0.8 * 0.019 / 0.0195)
    low = m.margin
    for _ in range(64):
        m.observe_tpot(0.012)  # well inside: back up 5% each 8 requests, to 0.85 at most
    assert low < m.margin <= 0.85 and not m.tpot_over
    for _ in range(200):
        m.observe_tpot(0.012)
    assert m.margin == 0.85


def test_an_engine_reports_each_finished_requests_tpot_to_its_step_model():
    llm = LLM(max_model_len=512, slo_tpot_s=0.5)
    e = llm.engine
    for n in (1, 6, 9):
        e.add_request(list(range(100, 120)), SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    while e.has_unfinished_requests():
        e.step()
    assert len(e.step_model.tpots) == 2  # the one-token request has no gap between tokens
    assert all(0 < t < 5 for t in e.step_model.tpots)
    assert e.stats().placement.tpot_margin == e.step_model.margin


def test_calibration_fits_the_model_before_the_first_request(tiny_models):
    """The runner's timed calibration steps (what a CUDA engine runs before it serves) leave a
    fitted model with a prefill cost and a measured prefill rate, and nothing banked."""
    llm = LLM(tiny_models["llama"], max_model_len=512, max_num_batched_tokens=512, slo_tpot_s=0.05)
    e = llm.engine
    assert e.step_model.coef is None  # CPU: not calibrated at start
    e.calibrate()
    m = e.step_model
    assert m.coef is not None and m.prefill_fitted and m.prefill_tok_s > 0 and m.slack == 0.0
    assert len(m.decode_steps) >= 4 and len(m.mixed_steps) >= 8
    assert m.rate_at(8, 8 * 512) is not None and m.chunk_at(8, 8 * 512) > 0
    e.kv.check_all_free()  # the dummy steps held no block
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4  # and the engine serves as before


def test_calibration_steps_store_nothing_on_the_decode_graph_path_too(tiny_models):
    """On CUDA a calibration decode batch takes the decode-graph layout (its slots are a column of
    `cols`, there is no `slots` array): every row's slot is -1 there too (it raised before)."""
    from pdserve.engine.exec import step_inputs
    from pdserve.engine.exec.step_inputs import StepPath

    llm = LLM(tiny_models["llama"], max_model_len=512)
    r = llm.engine.runner
    r.host_inputs = lambda batch: step_inputs.build(batch, StepPath.DECODE, 8, r.block_size, 8)
    inp = r._dummy_inputs([1, 1, 1], [40, 64, 100])
    assert isinstance(inp, step_inputs.DecodeRows) and inp.path == StepPath.DECODE
    assert (inp.cols[2] == -1).all() and (inp.cols[3][:3] == [40, 64, 100]).all()
