"""`ServerOptions`: the server-wide settings a request's own fields override (vLLM's server
flags of the same names), in one place: `pdserve serve` sets them, `build_app` reads them."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import MAX_N


@dataclass(frozen=True)
class ServerOptions:
    force_include_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: log-probs name "token_id:<id>"
    load_tracking: bool = False  # --enable-server-load-tracking: GET /load answers the requests in flight
    # --max-request-tokens: the most work one request may ask for, in tokens (request_work()); more is a 400
    # naming it. None: MAX_N x max_model_len, so that one prompt at any n and max_tokens always fits
    max_request_tokens: int | None = None

    def request_token_limit(self, max_model_len: int) -> int:
        return self.max_request_tokens if self.max_request_tokens is not None else MAX_N * max_model_len


def request_work(prompts: list[list[int]], params: list) -> int:
    """The tokens of work a request asks for at most, before it starts: each prompt prefilled once
    (its other copies find it in the prefix cache) or, with prompt_logprobs, its scores rendered
    on each of its n copies; plus every sequence's max_tokens. `params`: each prompt's sampling
    parameters (max_tokens resolved)."""
    work = 0
    for ids, p in zip(prompts, params):
        work += len(ids) * (p.n if p.prompt_logprobs is not None else 1) + p.n * p.max_tokens
    return work
