"""The one validation of a request against the model's limits (`check_request`), made at the
edge: the HTTP router before it queues a request (a refusal is a 400 naming the field, before any
worker or stream is involved) through the cluster, or `LLMEngine.make_request` for a caller of
the engine itself. What it returns, a `ValidRequest`, is what crosses to the workers: an engine
admits it checking only what it alone knows (its KV capacity: `check_capacity`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A request the model cannot serve; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ValidRequest:
    """A prompt and its sampling parameters that `check_request` passed, their max_tokens resolved
    (the rest of max_model_len when the client set none). Made by `check_request` only."""

    prompt_token_ids: list[int]
    params: SamplingParams

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def samples(self) -> list[ValidRequest]:
        """One per sequence of n (SamplingParams.samples(): their seeds differ, their limits do not)."""
        return [dataclasses.replace(self, params=p) for p in self.params.samples()]

    def first_token(self) -> ValidRequest:
        """The prefill role's part: the first token only (min_tokens >= 1 still keeps EOS and the
        stop ids out of it)."""
        params = dataclasses.replace(self.params, max_tokens=1, min_tokens=min(self.params.min_tokens, 1))
        return dataclasses.replace(self, params=params)


def check_capacity(request: ValidRequest, kv_capacity_tokens: int) -> None:
    """What only an engine knows: whether the request fits its KV cache whole."""
    n = len(request.prompt_token_ids) + request.max_tokens
    if n > kv_capacity_tokens:
        raise InvalidRequest(f"prompt + max_tokens = {n} tokens cannot fit in the KV cache "
                             f"({kv_capacity_tokens} tokens)", "max_tokens")


def check_request(token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                  bounded: bool = True) -> ValidRequest:
    """Raises InvalidRequest naming the problem. The request's max_tokens: the rest of
    max_model_len when params.max_tokens is None. `bounded` False (kv_window_tokens,
    engine/base/kv_window.py): a request's length is not bounded by max_model_len or the KV cache;
    max_tokens defaults to max_model_len."""
    if not token_ids:
        raise InvalidRequest("prompt is empty (no tokens)", "prompt")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids out of vocabulary (vocabulary size {vocab_size}: ids 0.."
                             f"{vocab_size - 1}): {bad[:5]}", "prompt")
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("logprob_token_ids", params.logprob_token_ids or ())):
        far = sorted(t for t in ids if not 0 <= t < vocab_size)
        if far:  # every one named (up to 64)
            more = f" and {len(far) - 64} more" if len(far) > 64 else ""
            raise InvalidRequest(f"{name} token ids out of vocabulary (vocabulary size {vocab_size}: ids 0.."
                                 f"{vocab_size - 1}): {far[:64]}{more}", name)
    n = len(token_ids)
    if not bounded:
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        if params.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        return _valid(token_ids, params, max_tokens)
    if n >= max_model_len:
        raise InvalidRequest(f"prompt has {n} tokens; max_model_len is {max_model_len} "
                             "(at least one token must be left to generate)", "prompt")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max_tokens > max_model_len:
        raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                             f"exceeds max_model_len ({max_model_len})", "max_tokens")
    if params.min_tokens > max_tokens:  # max_tokens unset: what the context leaves
        raise InvalidRequest(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this prompt "
                             f"can generate (max_model_len {max_model_len})", "min_tokens")
    return _valid(token_ids, params, max_tokens)


def _valid(token_ids: list[int], params: SamplingParams, max_tokens: int) -> ValidRequest:
    if params.max_tokens != max_tokens:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    return ValidRequest(list(token_ids), params)
