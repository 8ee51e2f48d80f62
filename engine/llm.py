"""`LLM`: the colocated, offline entry point (vLLM's `LLM.generate`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """LLM(model=None | "path/to/hf_dir", **engine_args).generate(prompts, params).

    model=None loads the default model (SmolLM2-135M-Instruct). Engine arguments
    take vLLM's names: dtype, block_size, max_model_len, gpu_memory_utilization,
    num_gpu_blocks_override, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, kv_cache_dtype, tensor_parallel_size, ...

    tensor_parallel_size=N runs ranks 1..N-1 in spawned processes on this host (one GPU
    each on CUDA, cuda:0..N-1); `close()` (or `with LLM(...) as llm:`) stops them.
    """

    def __init__(self, model: str | None = None, load_format: str = "auto", **engine_args):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, load_format=load_format, **engine_args))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def get_tokenizer(self):
        """transformers' tokenizer of the model (as vLLM's LLM.get_tokenizer)."""
        return self.engine.tokenizer.hf

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """`priority`: one per prompt (vLLM's; lower first under scheduling_policy "priority"),
        else each SamplingParams' own."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
            params = [dataclasses.replace(sp, priority=pr) for sp, pr in zip(params, priority)]
        # validate all before queueing any, so a bad prompt leaves nothing behind; n > 1: the
        # copies wait for the first to prefill, then hit its prompt's blocks in the prefix cache
        groups = [[self.engine.make_request(p, c) for c in sp.samples()] for p, sp in zip(prompts, params)]
        waiting = {g[0].request_id: g[1:] for g in groups if len(g) > 1}
        for g in groups:
            self.engine.add_request(g[0])
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=sum(map(len, groups)), desc="generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    for r in waiting.pop(out.request_id, ()):
                        self.engine.add_request(r)
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for g in groups:
                for r in g:
                    self.engine.abort_request(r.request_id)
            raise
        finally:
            bar.close()
        return [merge([final[r.request_id] for r in g]) for g in groups]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template, then generates (one conversation or a list;
        one SamplingParams for all or one per conversation, as `generate`)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer.hf
        prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)) for c in convs]
        return self.generate(prompts, sampling_params)


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """n finished outputs of one prompt as one, with n completions (index 0..n-1)."""
    first = outs[0]
    for i, o in enumerate(outs):
        o.outputs[0].index = i
    first.outputs = [o.outputs[0] for o in outs]
    return first
