"""Prometheus metrics, vLLM's names where vLLM has one.

Request-side ones (TTFT, inter-token and end-to-end latency, phases before the first
token, handoffs, finished requests and tokens) come from the cluster's dispatcher, the
one place that measures them (`RouterMetrics` is a RequestObserver). Worker-side state
(running/waiting, KV usage, prefix-cache queries and hits, preemptions) is read at
scrape time from the cluster's snapshot of what its monitor collected, so a scrape
never calls into the workers. Every series carries `model_name` (the served name, as
vLLM's do), as its last label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.cluster.api import RequestObserver

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class _WorkerCollector:
    def __init__(self, cluster, model_name: str):
        self.cluster, self.model = cluster, model_name

    def collect(self):
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch", "num_running"),
            "vllm:num_requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
            "vllm:kv_cache_usage_perc": ("KV-cache usage, 1 = full", "kv_cache_usage"),
            "pdserve:kv_blocks_used": ("KV blocks referenced", "kv_blocks_used"),
            "pdserve:kv_blocks_total": ("KV blocks in the pool", "kv_blocks_total"),
            "pdserve:kv_host_blocks_used": ("Host-tier KV blocks holding a prefix block", "kv_host_blocks_used"),
            "pdserve:kv_host_blocks_total": ("Host-tier KV block slots", "kv_host_blocks_total"),
        }
        counters = {
            "vllm:prefix_cache_queries": ("Prefix-cache queries, in tokens", "prefix_cache_queries"),
            "vllm:prefix_cache_hits": ("Prefix-cache hits, in tokens", "prefix_cache_hits"),
            "vllm:num_preemptions": ("Preemptions", "num_preemptions"),
            "pdserve:kv_offloaded_blocks": ("KV blocks copied to the host tier", "kv_offloaded_blocks"),
            "pdserve:prefix_cache_host_hits": ("Prefix-cache hits loaded back from the host tier, in tokens",
                                               "prefix_cache_host_hits"),
            "pdserve:kv_load_back_seconds": ("Time spent loading host-tier blocks back", "kv_load_back_seconds"),
            "vllm:spec_decode_num_drafts": ("Requests that carried draft tokens into a step", "spec_decode_num_drafts"),
            "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed", "spec_decode_num_draft_tokens"),
            "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted", "spec_decode_num_accepted_tokens"),
            "pdserve:spec_decode_draft_seconds": ("Time spent proposing drafts", "spec_decode_draft_seconds"),
            "pdserve:spec_decode_steps_off": ("Steps the off-switch ran without drafts", "spec_decode_steps_off"),
        }
        snap = self.cluster.snapshot()
        for family, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, key) in table.items():
                m = family(name, doc, labels=["worker", "role", "model_name"])
                for w in snap.workers:
                    if w.get(key) is not None:
                        m.add_metric([w["worker_id"], w["role"], self.model], float(w[key]))
                yield m
        routing = CounterMetricFamily("pdserve:routing_decisions", "Placement decisions by reason",
                                      labels=["reason", "model_name"])
        for reason, n in sorted(snap.routing.items()):
            routing.add_metric([reason, self.model], float(n))
        yield routing
        pools = GaugeMetricFamily("pdserve:pool_size", "Workers per pool (not draining)", labels=["role", "model_name"])
        for role, n in snap.pool_sizes.items():
            pools.add_metric([role, self.model], float(n))
        yield pools


class RouterMetrics(RequestObserver):
    def __init__(self, cluster, model_name: str):
        self.registry = CollectorRegistry()
        self.model = model_name
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*labels, *m], buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between streamed tokens")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency")
        self.requests = Counter("vllm:request_success", "Finished requests by reason", ["finished_reason", *m],
                                registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=r)
        self.http_errors = Counter("pdserve:http_errors", "Requests refused by status code", ["code", *m], registry=r)
        self.handoff_bytes = Counter("pdserve:kv_handoff_bytes", "KV bytes moved prefill -> decode", m, registry=r)
        self.handoff_seconds = hist("pdserve:kv_handoff_seconds", "KV handoff latency")
        self.phase_seconds = hist("pdserve:request_phase_seconds", "Phases of a request before its first token "
                                  "(prefill, decode_reserve, kv_to_first_token, local_prefill, local_to_first_token, "
                                  "local_first_token)", ("phase",))
        r.register(_WorkerCollector(cluster, model_name))
        self._latency = {"ttft": self.ttft, "itl": self.itl, "e2e": self.e2e}
        cluster.add_observer(self)

    def on_latency(self, kind: str, seconds: float) -> None:
        self._latency[kind].labels(self.model).observe(seconds)

    def on_phase(self, name: str, seconds: float) -> None:
        self.phase_seconds.labels(name, self.model).observe(seconds)

    def on_handoff(self, result: dict) -> None:
        self.handoff_bytes.labels(self.model).inc(result.get("bytes") or 0)
        if result.get("seconds") is not None:
            self.handoff_seconds.labels(self.model).observe(result["seconds"])

    def on_finish(self, reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.requests.labels(reason, self.model).inc()
        self.prompt_tokens.labels(self.model).inc(num_prompt_tokens)
        self.generation_tokens.labels(self.model).inc(num_output_tokens)

    def refused(self, status: int) -> None:
        self.http_errors.labels(str(status), self.model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
