"""The prefill role: run prompts (chunked prefill, prefix caching), sample token #1,
hand the KV off, keep the blocks in the prefix cache.

A prefill is the engine's ordinary request with max_tokens=1; the only difference
is that its blocks outlive the request until the handoff that reads them is done.

    add()   queue a prompt
    step()  one engine step; returns requests whose prompt is done
    send()  start the handoff of a done request to a decode worker
    poll()  finished handoffs; their block references are dropped here
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.transfer import handoff
from pdserve.transfer.base import Channel, Handoff, KVConnector


@dataclass
class Prefilled:
    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    # the request ended on its first token (EOS, stop, max_tokens=1): nothing to hand off
    finished: bool
    output: RequestOutput
    num_cached_tokens: int


class PrefillWorker:
    def __init__(self, engine: LLMEngine, connector: KVConnector):
        self.engine = engine
        self.connector = connector
        engine.hold_blocks_on_finish = True
        self.params: dict[str, SamplingParams] = {}
        # request -> CUDA event after the step that wrote its KV, so that send() can run
        # on any thread while the engine's next step is already queued
        self.ready: dict[str, object] = {}

    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> Request:
        one = dataclasses.replace(params, max_tokens=1, min_tokens=0)
        req = self.engine.make_request(prompt, one, request_id)
        # validate against the real max_tokens too, so decode never gets an impossible request
        self.engine.make_request(req.prompt_token_ids, params, request_id + "#check")
        self.params[request_id] = params
        return self.engine.add_request(req)

    def step(self) -> list[Prefilled]:
        done = []
        event = None
        for out in self.engine.step():
            if not out.finished:
                continue
            params = self.params.pop(out.request_id, None)
            first = out.outputs[0].token_ids[0]
            ended = (out.outputs[0].finish_reason == "stop"
                     or (params is not None and params.max_tokens == 1))
            if ended:
                self.engine.release(out.request_id)
            elif self.engine.runner.device.type == "cuda":
                if event is None:
                    event = torch.cuda.Event()
                    event.record()
                self.ready[out.request_id] = event
            done.append(Prefilled(out.request_id, out.prompt_token_ids, first, ended, out,
                                  out.num_cached_tokens))
        return done

    def send(self, request_id: str, peer: str, peer_address: str, num_skip: int, channel: Channel,
             timeout_s: float = 30.0) -> Handoff:
        req = self.engine.held.get(request_id)
        if req is None:
            raise KeyError(f"no prefilled request {request_id!r} is waiting for a handoff")
        blocks = handoff.blocks_to_send(self.engine.kv, req, num_skip)
        return self.connector.start_send(peer, peer_address, request_id, blocks, channel, timeout_s,
                                         ready=self.ready.pop(request_id, None))

    def poll(self) -> list[Handoff]:
        finished = self.connector.poll()
        for h in finished:
            self.ready.pop(h.request_id, None)
            self.engine.release(h.request_id)  # blocks stay in the prefix cache at ref 0
        return finished

    def abort(self, request_id: str) -> None:
        self.params.pop(request_id, None)
        self.ready.pop(request_id, None)
        self.connector.abort(request_id)
        self.engine.abort_request(request_id)
        self.engine.release(request_id)

    def is_idle(self) -> bool:
        return not self.engine.has_unfinished_requests() and not self.engine.held
