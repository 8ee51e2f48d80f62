"""ModelRunner.execute gives its step's result as a StepResult: the sampled tokens and the
log-probs of the requests that asked, kept intact when the next step runs."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.exec.step_inputs import StepPath
from pdserve.engine.exec.step_result import StepResult
from pdserve.engine.sampling_params import SamplingParams


def test_a_step_result_is_the_step_s_own_and_outlives_the_next_step(tiny_models):
    eng = LLMEngine(EngineConfig(model=tiny_models["llama"], max_model_len=128, async_scheduling=False))
    eng.add_request(list(range(5, 25)), SamplingParams(max_tokens=4, logprobs=2, temperature=0.0), request_id="a")
    eng.add_request(list(range(30, 40)), SamplingParams(max_tokens=4, temperature=0.0), request_id="b")
    first = eng.runner.execute(sched := eng.scheduler.schedule())
    assert isinstance(first, StepResult) and set(first.tokens) == {"a", "b"}
    assert set(first.logprobs) == {"a"} and first.tokens["a"] in first.logprobs["a"]  # the sampled token's entry
    assert len(first.logprobs["a"]) >= 2 and not first.prompt_logprobs and not first.dead_ends
    eng.scheduler.update_after_step(sched)
    eng._postprocess(sched, first)
    snapshot = {k: dict(v) for k, v in first.logprobs.items()}
    sched = eng.scheduler.schedule()
    assert eng.runner.host_inputs(eng.runner.order(sched.scheduled)).path == StepPath.EAGER  # no graphs on CPU
    second = eng.runner.execute(sched)
    assert first.logprobs == snapshot and second.logprobs is not first.logprobs
    assert set(second.tokens) == {"a", "b"} and set(second.logprobs) == {"a"}
