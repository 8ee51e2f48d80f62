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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdserve.cluster.api import FinishedRequest, HandoffResult, RequestObserver

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
REQUEST_SECONDS_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def settled(w: dict) -> dict:
    """A worker's row with its running and waiting counts bounded by the requests this router
    has on it now (`load`): the monitor's stats are up to a second old, the router's count
    drops the moment a request finishes, so the gauges settle then."""
    if w.get("load") is None or w.get("num_running") is None:
        return w
    running = min(w["num_running"], w["load"])
    return {**w, "num_running": running, "num_waiting": min(w.get("num_waiting") or 0, w["load"] - running)}


# per-worker series read from the workers' stats: name -> (help, stats key)
WORKER_GAUGES = {
    "vllm:num_requests_running": ("Requests in the running batch", "num_running"),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage, 1 = full", "kv_cache_usage"),
    "pdserve:kv_blocks_used": ("KV blocks referenced", "kv_blocks_used"),
    "pdserve:kv_blocks_total": ("KV blocks in the pool", "kv_blocks_total"),
    "pdserve:kv_host_blocks_used": ("Host-tier KV blocks holding a prefix block", "kv_host_blocks_used"),
    "pdserve:kv_host_blocks_total": ("Host-tier KV block slots", "kv_host_blocks_total"),
    "pdserve:kv_disk_blocks": ("Disk-tier KV blocks this worker knows on disk", "kv_disk_blocks"),
    "pdserve:kv_disk_blocks_total": ("Disk-tier KV blocks the size holds", "kv_disk_blocks_total"),
    "pdserve:kv_disk_read_gbps": ("The disk tier's measured read bandwidth, GB/s", "kv_disk_read_gbps"),
    "pdserve:kv_disk_prefetch_seconds": ("Mean time a request waited for its disk blocks",
                                         "kv_disk_prefetch_seconds"),
    "pdserve:kv_disk_waiting": ("Requests waiting for their disk blocks", "kv_disk_waiting"),
    "pdserve:kv_peer_waiting": ("Requests waiting for a prefix fetched from a peer", "kv_peer_waiting"),
    "pdserve:kv_peer_fetch_gbps": ("Measured bandwidth of this worker's peer fetches (ask to landing), GB/s",
                                   "kv_peer_fetch_gbps"),
    "pdserve:kv_peer_fetch_seconds": ("Mean time a request waited for its peer fetch (failed ones too)",
                                      "kv_peer_fetch_seconds"),
    "pdserve:kv_disk_unwritable": ("1 while the disk tier's directory takes no writes (its blocks are not kept)",
                                   "kv_disk_unwritable"),
    "pdserve:kv_persist_unwritable": ("1 while the persisted host tier's directory takes no writes",
                                      "kv_persist_unwritable"),
}
WORKER_COUNTERS = {
    "vllm:prefix_cache_queries": ("Prefix-cache queries, in tokens", "prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("Prefix-cache hits, in tokens", "prefix_cache_hits"),
    "vllm:num_preemptions": ("Preemptions", "num_preemptions"),
    "pdserve:kv_evicted_blocks": ("Prefix-cached KV blocks reused for other tokens (evicted)",
                                  "kv_evicted_blocks"),
    "pdserve:kv_offloaded_blocks": ("KV blocks copied to the host tier", "kv_offloaded_blocks"),
    "pdserve:prefix_cache_host_hits": ("Prefix-cache hits loaded back from the host tier, in tokens",
                                       "prefix_cache_host_hits"),
    "pdserve:kv_load_back_seconds": ("Time spent loading host-tier blocks back", "kv_load_back_seconds"),
    "pdserve:prefix_cache_disk_hits": ("Prefix-cache hits read back from the disk tier, in tokens",
                                       "prefix_cache_disk_hits"),
    "pdserve:kv_disk_skipped_tokens": ("Prompt tokens on disk recomputed instead (predicted faster)",
                                       "kv_disk_skipped_tokens"),
    "pdserve:kv_disk_written_bytes": ("Bytes written to the disk tier", "kv_disk_written_bytes"),
    "pdserve:kv_disk_read_bytes": ("Bytes read from the disk tier", "kv_disk_read_bytes"),
    "pdserve:kv_disk_refused_blocks": ("Disk-tier blocks refused on read (size, hash or checksum)",
                                       "kv_disk_refused_blocks"),
    "pdserve:kv_disk_write_errors": ("Disk-tier writes that failed (read-only, full, I/O error)",
                                     "kv_disk_write_errors"),
    "pdserve:kv_persist_write_errors": ("Persisted host-tier writes that failed (read-only, full, I/O error)",
                                        "kv_persist_write_errors"),
    "pdserve:prefix_cache_peer_hits": ("Prefix-cache hits fetched from a peer worker's GPU, in tokens",
                                       "prefix_cache_peer_hits"),
    "pdserve:kv_peer_fetched_bytes": ("KV bytes fetched from peers (rank 0's share on a tensor-parallel worker)",
                                      "kv_peer_fetched_bytes"),
    "pdserve:kv_peer_served_bytes": ("KV bytes sent to peers that fetched them (rank 0's share under TP)",
                                     "kv_peer_served_bytes"),
    "pdserve:kv_peer_fetches": ("Peer fetches ended (landed or failed)", "kv_peer_fetches"),
    "pdserve:kv_peer_fetches_failed": ("Peer fetches that failed or were refused (recomputed instead)",
                                       "kv_peer_fetches_failed"),
    "vllm:spec_decode_num_drafts": ("Requests that carried draft tokens into a step", "spec_decode_num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed", "spec_decode_num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted", "spec_decode_num_accepted_tokens"),
    "pdserve:spec_decode_draft_seconds": ("Time spent proposing drafts", "spec_decode_draft_seconds"),
    "pdserve:spec_decode_steps_off": ("Steps the off-switch ran without drafts", "spec_decode_steps_off"),
    "pdserve:kernel_compiles_serving": ("Triton kernel variants compiled after the worker started (a step waited "
                                        "for each)", "kernel_compiles_serving"),
}


class _WorkerCollector:
    def __init__(self, cluster, model_name: str):
        self.cluster, self.model = cluster, model_name

    def collect(self):
        snap = self.cluster.snapshot()
        snap.workers = [settled(w) for w in snap.workers]
        for family, table in ((GaugeMetricFamily, WORKER_GAUGES), (CounterMetricFamily, WORKER_COUNTERS)):
            for name, (doc, key) in table.items():
                m = family(name, doc, labels=["worker", "role", "model_name"])
                for w in snap.workers:
                    if w.get(key) is not None:
                        m.add_metric([w["worker_id"], w["role"], self.model], float(w[key]))
                yield m
        yield from self._cluster_wide(snap)
        yield self._waiting_by_reason(snap)
        steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step",
                                      labels=["worker", "role", "model_name"])
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (value 1)",
                                 labels=["worker", "role", "model_name", "block_size", "cache_dtype", "num_gpu_blocks",
                                         "num_cpu_blocks", "enable_prefix_caching", "kv_cache_size_tokens",
                                         "kv_cache_max_concurrency"])
        for w in snap.workers:
            if w.get("iteration_tokens"):
                h = w["iteration_tokens"]
                steps.add_metric([w["worker_id"], w["role"], self.model], [tuple(b) for b in h["buckets"]], h["sum"])
            if w.get("cache_config"):
                c = w["cache_config"]
                info.add_metric([w["worker_id"], w["role"], self.model, str(c["block_size"]), str(c["cache_dtype"]),
                                 str(c["num_gpu_blocks"]), str(c["num_cpu_blocks"]),
                                 str(c["enable_prefix_caching"]), str(c["num_gpu_blocks"] * c["block_size"]),
                                 f'{c["num_gpu_blocks"] * c["block_size"] / c["max_model_len"]:.2f}'], 1.0)
        yield steps
        yield info
        routing = CounterMetricFamily("pdserve:routing_decisions", "Placement decisions by reason",
                                      labels=["reason", "model_name"])
        for reason, n in sorted(snap.routing.items()):
            routing.add_metric([reason, self.model], float(n))
        yield routing
        pools = GaugeMetricFamily("pdserve:pool_size", "Workers per pool (not draining)", labels=["role", "model_name"])
        for role, n in snap.pool_sizes.items():
            pools.add_metric([role, self.model], float(n))
        yield pools

    def _waiting_by_reason(self, snap):
        """vLLM's: the waiting requests of each worker by what they wait for: "capacity" (room
        in the batch or the KV cache) or "deferred" (their KV from a prefill worker, their
        grammar's compile)."""
        m = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Waiting requests by reason",
                              labels=["worker", "role", "reason", "model_name"])
        for w in snap.workers:
            if w.get("num_waiting") is not None:
                m.add_metric([w["worker_id"], w["role"], "capacity", self.model], float(w["num_waiting"]))
                m.add_metric([w["worker_id"], w["role"], "deferred", self.model], float(w.get("num_deferred") or 0))
        return m

    def _cluster_wide(self, snap):
        """The running and waiting requests of the whole cluster (one series each; vLLM's are
        per engine, here per worker)."""
        for name, doc, key in (("pdserve:cluster_num_requests_running", "Requests running on any worker",
                                "num_running"),
                               ("pdserve:cluster_num_requests_waiting", "Requests waiting on any worker",
                                "num_waiting")):
            m = GaugeMetricFamily(name, doc, labels=["model_name"])
            m.add_metric([self.model], float(sum(w.get(key) or 0 for w in snap.workers)))
            yield m


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
        self.admission_rejections = Counter("vllm:admission_rejections", "Requests refused at admission: the "
                                            "queue full (429) or no worker to serve them (503)", ["reason", *m],
                                            registry=r)
        self.stalled_streams = Counter("pdserve:stalled_streams", "Connections aborted because their client read "
                                       "nothing for the write-stall bound (their requests cancelled)", m, registry=r)
        self.request_preemptions = Histogram("vllm:request_num_preemptions", "Preemptions per finished request", m,
                                             buckets=(0, 1, 2, 5, 10, 20, 50), registry=r)
        self.handoff_bytes = Counter("pdserve:kv_handoff_bytes", "KV bytes moved prefill -> decode, by the link "
                                     "that moved them (cuda-ipc, shared-memory, nccl, gloo)", ["link", *m],
                                     registry=r)
        self.handoff_seconds = hist("pdserve:kv_handoff_seconds", "KV handoff latency by link", ("link",))
        def counts(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=TOKEN_BUCKETS, registry=r)

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=REQUEST_SECONDS_BUCKETS, registry=r)

        self.request_prompt_tokens = counts("vllm:request_prompt_tokens", "Prompt tokens per request")
        self.request_generation_tokens = counts("vllm:request_generation_tokens", "Generated tokens per request")
        self.params_n = counts("vllm:request_params_n", "The n of each request")
        self.params_max_tokens = counts("vllm:request_params_max_tokens", "The max_tokens of each request")
        self.request_seconds = {
            "queue": seconds("vllm:request_queue_time_seconds", "Arrival to a worker's first step of the request"),
            "prefill": seconds("vllm:request_prefill_time_seconds", "That step to the first token"),
            "decode": seconds("vllm:request_decode_time_seconds", "The first token to the last"),
            "inference": seconds("vllm:request_inference_time_seconds", "The first step to the last token")}
        # per SamplingParams.priority (--scheduling-policy priority): who waits, who is preempted
        self.priority_ttft = hist("pdserve:time_to_first_token_by_priority_seconds", "Time to first token per "
                                  "request priority", ("priority",))
        self.priority_requests = Counter("pdserve:requests_by_priority", "Finished requests per priority",
                                         ["priority", *m], registry=r)
        self.priority_preemptions = Counter("pdserve:request_preemptions_by_priority", "Preemptions of finished "
                                            "requests per priority", ["priority", *m], registry=r)
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

    def on_handoff(self, result: HandoffResult) -> None:
        link = result.link or "none"  # a handoff of no blocks (all prefix hits) used no link
        self.handoff_bytes.labels(link, self.model).inc(result.nbytes)
        if result.seconds is not None:
            self.handoff_seconds.labels(link, self.model).observe(result.seconds)

    def on_finish(self, done: FinishedRequest) -> None:
        self.requests.labels(done.reason, self.model).inc()
        self.prompt_tokens.labels(self.model).inc(done.num_prompt_tokens)
        self.generation_tokens.labels(self.model).inc(done.num_output_tokens)
        self.request_prompt_tokens.labels(self.model).observe(done.num_prompt_tokens)
        self.request_generation_tokens.labels(self.model).observe(done.num_output_tokens)
        prio = str(done.priority)
        self.priority_requests.labels(prio, self.model).inc()
        self.priority_preemptions.labels(prio, self.model).inc(done.num_preemptions)
        self.request_preemptions.labels(self.model).observe(done.num_preemptions)
        if done.ttft_s is not None:
            self.priority_ttft.labels(prio, self.model).observe(done.ttft_s)
        for kind, sec in (("queue", done.queue_s), ("prefill", done.prefill_s), ("decode", done.decode_s),
                          ("inference", done.inference_s)):
            if sec is not None:
                self.request_seconds[kind].labels(self.model).observe(sec)

    def on_params(self, n: int, max_tokens: int) -> None:
        """A request the router accepted (its n and its max_tokens, after the default)."""
        self.params_n.labels(self.model).observe(n)
        self.params_max_tokens.labels(self.model).observe(max_tokens)

    def refused(self, status: int, admission: str | None = None) -> None:
        """A request answered with an error; `admission`: why it was not admitted (queue_full,
        no_worker), None for any other refusal."""
        self.http_errors.labels(str(status), self.model).inc()
        if admission is not None:
            self.admission_rejections.labels(admission, self.model).inc()

    def stalled(self) -> None:
        """A connection aborted for not reading (router/server.py)."""
        self.stalled_streams.labels(self.model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
