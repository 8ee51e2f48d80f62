"""The draft-model proposer (speculative_config method "draft_model"): a small model with the
target's vocabulary proposes k tokens greedily, in the same process as the target (rank 0).

Each target request has a shadow request in the draft model's own paged KV cache:

    catch up   the tokens the draft has not seen, in one batched step whose last position
               samples draft 1: the whole prompt the first time (on a decode worker, the
               handed-off prompt is prefilled here by the draft model), then the tokens
               accepted since
    draft      k - 1 more single-token greedy steps (CUDA graphs on GPU), each writing its
               token's KV
    rollback   the next catch-up starts at the longest prefix the shadow shares with the
               target's tokens: KV of accepted drafts is kept, the rejected drafts' slots are
               simply overwritten
    forget     the target request ended: the shadow's blocks are freed

Cost per target step: one small batched step plus k - 1 draft decode steps; per request, one
draft-model prefill of its prompt (for a 135M draft of an 8B target, ~1/50 of the target's
prefill FLOPs). Drafts are greedy (deterministic), so the target's rejection sampling
(verify.verify_sampled) keeps its distribution exactly.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..core.kv_cache_manager import KVCacheManager
from ..core.request import Request
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30)


class DraftModelProposer:
    def __init__(self, model: str, target: EngineConfig, kv_cache_memory_bytes: int):
        from ..exec.model_runner import ModelRunner
        from ..exec.runner_settings import RunnerSettings

        cfg = EngineConfig(model=model, dtype=target.dtype, device=target.device, max_model_len=target.max_model_len,
                           kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=target.max_num_seqs,
                           max_num_batched_tokens=target.max_num_batched_tokens, enable_prefix_caching=False,
                           enforce_eager=target.enforce_eager)
        cfg.resolve(model)
        tv, dv = target.model_config.vocab_size, cfg.model_config.vocab_size
        if tv != dv:
            raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv})")
        self.runner = ModelRunner(RunnerSettings.of(cfg))
        self.kv = KVCacheManager(self.runner.num_blocks, cfg.block_size, False)
        self.shadows: dict[str, Request] = {}

    def _sync(self, req) -> Request:
        """The request's shadow, rolled back to the prefix it shares with the target's tokens."""
        sh = self.shadows.get(req.request_id)
        tokens = req.all_token_ids
        if sh is None:
            sh = self.shadows[req.request_id] = Request(req.request_id, list(req.prompt_token_ids), GREEDY)
        common = 0
        for a, b in zip(sh.all_token_ids, tokens):
            if a != b:
                break
            common += 1
        sh.all_token_ids = list(tokens)
        sh.num_computed_tokens = min(sh.num_computed_tokens, common, len(tokens) - 1)
        return sh

    def propose(self, reqs: list, rooms: list[int]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        live = []
        for req, room in zip(reqs, rooms):
            if room > 0:
                live.append((self._sync(req), room))
                drafts[req.request_id] = []
        for step in range(max((room for _, room in live), default=0)):
            batch = []
            for sh, room in live:
                if step >= room or len(drafts[sh.request_id]) < step:
                    continue
                n = sh.num_tokens - sh.num_computed_tokens
                blocks = self.kv.allocate_slots(sh, n)
                if blocks is None:  # the draft's cache is full: this request drafts no further
                    continue
                batch.append(ScheduledRequest(sh, n, [b.block_id for b in blocks]))
            if not batch:
                break
            tokens = self.runner.execute(SchedulerOutput(batch)).tokens
            for s in batch:
                s.request.num_computed_tokens += s.num_new_tokens
                token = tokens[s.request.request_id]
                s.request.all_token_ids.append(token)
                drafts[s.request.request_id].append(token)
        return drafts

    def forget(self, request_id: str) -> None:
        sh = self.shadows.pop(request_id, None)
        if sh is not None:
            self.kv.free(sh)
