"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .base.grammar_spec import check_spec

MAX_N = 16  # completions per prompt
MAX_LOGPROBS = 20  # top log-probabilities per token, at most (OpenAI's chat limit; vLLM's default)

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a torch.Generator seed (n copies add up to n - 1)


class InvalidParam(ValueError):
    """A request parameter out of its range or shape; `param` names it (the router's 400 does)."""

    def __init__(self, param: str, message: str):
        """`message` says what is wrong with it, after its name (added when it does not begin so)."""
        super().__init__(message if message.startswith(param) else f"{param} {message}")
        self.param = param

@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1.0 disables
    top-p. `seed` makes a sampled request reproducible on its own, whatever else is
    in the batch. Stop strings are not included in the returned text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100)
    logprobs: int | None = None  # per output token: the sampled token's log-probability and the top N
    prompt_logprobs: int | None = None  # per prompt token after the first: its log-probability and the top N
    logprob_token_ids: list[int] | None = None  # with logprobs: these ids' log-probs too, at every token
    allowed_token_ids: list[int] | None = None  # sample only these (vLLM's)
    # {"json": schema} | {"json_object": True} | {"regex": r} | {"choice": [...]} | {"grammar": ebnf}
    # (engine/sample/structured.py)
    structured_outputs: dict | None = None
    # with scheduling_policy "priority": lower is served first, then earlier arrival (vLLM's);
    # it orders every queue the request waits in and picks preemption victims (core/scheduler.py)
    priority: int = 0
    stop_strs: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidParam("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidParam("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParam("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidParam("top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidParam("max_tokens", f"must be an integer >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidParam("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidParam("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed!r}")
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop_strs):
            raise InvalidParam("stop", f"must be non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise InvalidParam(name, f"must be in [-2, 2], got {v!r}")
        if isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float)) \
                or not 0.01 <= self.repetition_penalty <= 10.0:  # below: logits / p overflow float32
            raise InvalidParam("repetition_penalty", f"must be in [0.01, 10], got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidParam(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or \
                    any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise InvalidParam("allowed_token_ids", f"must be a non-empty list of token ids >= 0, got {ids!r}")
            self.allowed_token_ids = sorted(set(ids))
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or len(ids) > MAX_LOGPROBS or \
                    any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise InvalidParam("logprob_token_ids", f"must be 1 to {MAX_LOGPROBS} token ids >= 0, got {ids!r}")
            if self.logprobs is None:
                raise InvalidParam("logprob_token_ids", "needs logprobs (the sampled token's comes with theirs)")
            self.logprob_token_ids = list(dict.fromkeys(ids))
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias)
        try:
            self.structured_outputs = check_spec(self.structured_outputs)
        except ValueError as e:
            raise InvalidParam("structured_outputs", str(e)) from None
        if self.structured_outputs and self.ignore_eos:
            raise InvalidParam("structured_outputs", "with ignore_eos: a complete grammar allows only EOS")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or \
                not SEED_MIN <= self.priority <= SEED_MAX:
            raise InvalidParam("priority", f"must be an integer (lower is served first), got {self.priority!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids}")

    def samples(self) -> list[SamplingParams]:
        """The n sequences as n single ones (the engine runs one sequence per request); a
        seeded request's copies take seeds seed, seed + 1, ... so they differ and repeat. The
        prompt's log-probs are the first copy's (the others hit its blocks in the prefix cache)."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i,
                        prompt_logprobs=self.prompt_logprobs if i == 0 else None) for i in range(self.n)]

    @property
    def adjusts_logits(self) -> bool:
        """Whether the request changes its logits before sampling (sample/logits_process.py)."""
        return bool(self.logit_bias) or self.penalized or self.allowed_token_ids is not None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def row(self) -> tuple[float, float, float, float, float]:
        """What the sampler uploads for a row of this request (sample/sampler.RowParams):
        temperature (1 when greedy), top_p, min_p, top_k (inf: the whole vocabulary), greedy."""
        greedy = self.greedy
        return (1.0 if greedy else self.temperature, self.top_p, self.min_p,
                self.top_k if self.top_k > 0 else float("inf"), float(greedy))


def _checked_bias(logit_bias) -> dict[int, float]:
    """OpenAI's logit_bias (JSON keys are strings) as {token id: bias}; InvalidParam naming every
    bad key and value at once."""
    if not isinstance(logit_bias, dict):
        raise InvalidParam("logit_bias", f"must map token ids to biases, got {type(logit_bias).__name__}")
    bias, keys, values = {}, [], []
    for t, b in logit_bias.items():
        try:
            tok = int(t)
        except (TypeError, ValueError):
            keys.append(t)
            continue
        if tok < 0 or isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            values.append(f"{t!r}: {b!r}")
            continue
        bias[tok] = float(b)
    if keys or values:
        why = ([f"keys must be token ids, got {', '.join(map(repr, keys))}"] if keys else []) + \
            ([f"must map token ids >= 0 to values in [-100, 100], got {', '.join(values)}"] if values else [])
        raise InvalidParam("logit_bias", "; ".join(why))
    return bias
