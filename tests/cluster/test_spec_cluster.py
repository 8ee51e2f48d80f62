"""Speculative decoding on the decode pool of the real cluster: the prefill worker sends the
KV and the first token, the decode worker drafts (ngram) and verifies; greedy output equals
`LLM` without speculation; the counters reach /metrics."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.engine.exec.loader import resolve_model_path
from pdserve.router.metrics import RouterMetrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # a real-model or multi-actor cluster per module

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 64}
PROMPTS = ["Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", "Say it twice: the cat sat on the mat. the cat sat"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_pool_speculates_with_llms_tokens(method):
    """draft_model: the default model drafts for itself; on the decode worker the draft model
    prefills the handed-off prompt into its own KV cache first (spec/draft.py)."""
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": resolve_model_path(None),
                                            "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    with LLM(max_model_len=256) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    c = Cluster.start(prefill=1, decode=1, max_model_len=256, speculative_config=spec, mode="disaggregated")
    try:
        outs = c.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        dec = next(r for r in c.status() if r["role"] == "decode")
        assert dec["spec_decode_draft_seconds"] > 0
        assert dec["spec_decode_num_accepted_tokens"] > 5 and all(o.decode_worker == dec["worker_id"] for o in outs)
        deadline = time.monotonic() + 10
        name = "vllm:spec_decode_num_accepted_tokens_total{"
        while name not in generate_latest(RouterMetrics(c, "m").registry).decode():
            assert time.monotonic() < deadline
            time.sleep(0.3)
    finally:
        c.shutdown()
