"""The decode role: reserve blocks, receive KV, decode in the continuous batch.

    reserve()  blocks for a prefilled prompt, minus the prefix it already holds
    recv()     start receiving the rest from the prefill worker
    poll()     finished handoffs: DONE joins the running batch (first output
               returned), FAILED frees the reservation
    step()     one engine step (continuous batching; preemption recomputes here)
"""

from __future__ import annotations

from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.transfer import handoff
from pdserve.transfer.base import Channel, Handoff, KVConnector, TransferState


class DecodeWorker:
    def __init__(self, engine: LLMEngine, connector: KVConnector):
        self.engine = engine
        self.connector = connector
        self.pending: dict[str, Request] = {}  # WAITING_FOR_KV

    def reserve(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                first_token: int) -> tuple[list[int], int] | None:
        """(block ids to fill, leading blocks already held), or None when out of blocks."""
        if request_id in self.pending or request_id in self.engine.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.engine.make_request(prompt_token_ids, params, request_id)
        req.append_token(first_token)
        req.status = RequestStatus.WAITING_FOR_KV
        res = handoff.reserve(self.engine.kv, req)
        if res is None:
            return None
        req.num_cached_tokens = res[1] * self.engine.config.block_size
        self.pending[request_id] = req
        return res

    def recv(self, request_id: str, peer: str, block_ids: list[int], channel: Channel,
             timeout_s: float = 30.0) -> Handoff:
        return self.connector.start_recv(peer, "", request_id, block_ids, channel, timeout_s)

    def new_channel(self, peer: str) -> Channel:
        return self.connector.new_channel(peer)

    def poll(self) -> list[RequestOutput]:
        outs = []
        for h in self.connector.poll():
            req = self.pending.pop(h.request_id, None)
            if req is None:
                continue
            if h.state == TransferState.DONE:
                self.engine.kv.cache_blocks(req, req.num_prompt_tokens)
                outs.append(self.engine.admit_prefilled(req))
            else:
                handoff.release(self.engine.kv, req)
                req.status = RequestStatus.FINISHED_ERROR
                outs.append(RequestOutput(req.request_id, None, req.prompt_token_ids,
                                          [CompletionOutput(0, "", [], finish_reason="error",
                                                            stop_reason=f"KV handoff failed: {h.error}")],
                                          True))
        return outs

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.connector.abort(request_id)
        req = self.pending.pop(request_id, None)
        if req is not None:
            handoff.release(self.engine.kv, req)
        self.engine.abort_request(request_id)

    def is_idle(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()
