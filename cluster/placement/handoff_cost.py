"""What a handoff costs hybrid placement: learned from measured handoffs, per link.

A prompt prefilled on the prefill pool reaches its first token after its prefill plus the
handoff of its KV to the decode worker. Placement predicts that handoff as

    seconds = fixed_s + bytes / the (prefill, decode) link's bandwidth

    fixed_s    the kv_to_first_token phase (send start -> first token at the router, EWMA)
               less the transfers themselves (EWMA of their seconds): the receiver's
               admission and first step, whatever the link
    bandwidth  per (prefill worker, decode worker): EWMA of bytes / seconds of that pair's
               handoffs of at least MEASURE_BYTES (a small one measures only fixed costs);
               unmeasured, the start value of its kind (LINK_GBPS_START: on one node the pair
               maps the peer's KV, across nodes it goes over the network)

so a slow or loaded link raises the pool's predicted time to first token for the prompts
sent over it, and hybrid placement prefills them on the decode worker sooner. Links of
workers that left are forgotten.
"""

from __future__ import annotations

from ..records import WorkerRecord

# a fetch's or handoff's bandwidth until the pair has measured its own: on one node the pair
# pulls over CUDA IPC / shared memory (one H200: 29 GB/s for 512 MiB, 140 GB/s for 2 GB, fixed
# costs included: bench/results/kv_tiers/); across nodes NCCL or gloo, whose worst case (TCP) is
# about 1 GB/s
LINK_GBPS_START = {"same_node": 20.0, "network": 1.0}
MEASURE_BYTES = 1 << 20  # a handoff this big measures its link's bandwidth
WEIGHT = 0.2  # of a new measure in the EWMAs


class HandoffCost:
    def __init__(self, first_token_s: float = 0.02):
        self.first_token_s = first_token_s  # EWMA of kv_to_first_token
        self.wire_s = 0.0  # EWMA of the handoffs' own seconds
        self._gbps: dict[tuple[str, str], float] = {}  # (prefill id, decode id) -> measured GB/s

    @property
    def fixed_s(self) -> float:
        return max(0.0, self.first_token_s - self.wire_s)

    def observe_first_token(self, seconds: float) -> None:
        """A handed-off request's kv_to_first_token phase."""
        self.first_token_s += WEIGHT * (seconds - self.first_token_s)

    def observe_transfer(self, prefill: str, decode: str, nbytes: int, seconds: float | None) -> None:
        """A finished handoff from `prefill` to `decode`: `nbytes` in `seconds` (send start to end)."""
        if seconds is None or seconds <= 0:
            return
        self.wire_s += WEIGHT * (seconds - self.wire_s)
        if nbytes >= MEASURE_BYTES:
            gbps = nbytes / seconds / 1e9
            old = self._gbps.get((prefill, decode))
            self._gbps[(prefill, decode)] = gbps if old is None else old + WEIGHT * (gbps - old)

    def gbps(self, prefill: WorkerRecord, decode: WorkerRecord) -> tuple[float, bool]:
        """The link's bandwidth, and whether it was measured (else its kind's start value)."""
        got = self._gbps.get((prefill.worker_id, decode.worker_id))
        if got is not None:
            return got, True
        same = prefill.info is not None and decode.info is not None and prefill.info.same_node(decode.info)
        return LINK_GBPS_START["same_node" if same else "network"], False

    def predict(self, prefill: WorkerRecord, decode: WorkerRecord, tokens: int, block_size: int) -> float:
        """Seconds from the send's start to the first token of a handoff of `tokens` prompt tokens
        (whole blocks move); without the prefill worker's KV layout, the fixed part alone."""
        layout = prefill.info.layout if prefill.info is not None else None
        if layout is None or tokens <= 0:
            return self.fixed_s
        nbytes = -(-tokens // block_size) * layout.block_bytes
        return self.fixed_s + nbytes / (self.gbps(prefill, decode)[0] * 1e9)

    def links(self) -> dict[str, float]:
        """The measured links: "prefill->decode" -> GB/s."""
        return {f"{p}->{d}": round(g, 3) for (p, d), g in self._gbps.items()}

    def forget(self, live: set[str]) -> None:
        """Drops the links of workers that are not in `live`."""
        for key in [k for k in self._gbps if k[0] not in live or k[1] not in live]:
            del self._gbps[key]
