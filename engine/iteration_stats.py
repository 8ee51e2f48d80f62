"""What each engine step carried, as a cumulative histogram (vLLM's
`vllm:iteration_tokens_total`: tokens per step, prefill and decode together), kept in the
engine and reported with its stats; the router's metrics read it from the cluster's snapshot."""

from __future__ import annotations

import bisect

TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenHistogram:
    def __init__(self, buckets: tuple[int, ...] = TOKEN_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, tokens)] += 1
        self.sum += tokens

    def snapshot(self) -> dict:
        """{"buckets": [(le, cumulative count), ..., ("+Inf", count)], "sum"}: Prometheus' shape."""
        cum, out = 0, []
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cum += n
            out.append((le, cum))
        return {"buckets": out, "sum": self.sum}
