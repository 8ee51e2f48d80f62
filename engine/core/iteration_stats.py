"""What each engine step carried, as a cumulative histogram (vLLM's
`vllm:iteration_tokens_total`: tokens per step, prefill and decode together), kept in the
engine and reported with its stats; the router's metrics read it from the cluster's snapshot."""

from __future__ import annotations

import bisect

from ..stats import TokenCounts

TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenHistogram:
    def __init__(self, buckets: tuple[int, ...] = TOKEN_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, tokens)] += 1
        self.sum += tokens

    def snapshot(self) -> TokenCounts:
        """The cumulative counts by bucket, ("+Inf", count) last, and the sum: Prometheus' shape."""
        cum, out = 0, []
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cum += n
            out.append((le, cum))
        return TokenCounts(out, self.sum)


def step_tokens(scheduled: list, sampled: dict | None = None) -> int:
    """The tokens one step carried, as vLLM's iteration_tokens_total counts them: the prompt
    tokens each prefill chunk computed, plus each token the step sampled (a prefill's first
    token, a decode's token and its accepted drafts). `sampled`: the step's {request id:
    token or verified tokens}; None (an overlapped step, before its ids are known): one token
    per row that samples."""
    n = 0
    for s in scheduled:
        req = s.request
        if req.num_computed_tokens < req.num_prompt_tokens:  # before the step's update
            n += s.num_new_tokens
        if sampled is None:
            n += int(s.samples)
        else:
            got = sampled.get(req.request_id)
            n += 0 if got is None else len(got) if isinstance(got, list) else 1
    return n
