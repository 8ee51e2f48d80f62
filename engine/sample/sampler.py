"""Per-request sampling over a batch of logits: greedy, temperature, min-p, top-k, top-p, seed
(after the request's own logit adjustments, logits_process.py).

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p
exactly. A seeded request's E is a pure function of (seed, the output token's index, token id)
(sampling_noise.py), so it samples the same tokens whatever else shares its batch and wherever
its tokens are drawn: across a prefill/decode handoff, a retry, a preemption, a role switch or
speculative verification. The sampler keeps no per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..base.host_to_device import to_device
from ..core.request import Request
from ..sampling_params import SamplingParams
from . import sampling_noise
from .logits_process import process
from .verify import verify_greedy, verify_sampled


@dataclass(frozen=True)
class RowParams:
    """A step's rows' sampling parameters on the device, from one upload: a [5, rows] float32
    array whose rows are contiguous views (a broadcast [rows, 1] operand with a stride would turn
    the [rows, vocab] divisions and comparisons into non-vectorized kernels). top_k is a float
    (exact below 2^24; inf keeps the whole vocabulary); a greedy row's temperature is 1."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor
    greedy: torch.Tensor  # bool

    @staticmethod
    def of(rows: list[tuple[float, ...]], device) -> RowParams:
        """`rows`: each row's SamplingParams.row() (a request caches its own: Request.sampling_row)."""
        t = to_device(np.ascontiguousarray(np.array(rows, dtype=np.float32).T), device)
        return RowParams(t[0], t[1], t[2], t[3], t[4] > 0)


class Sampler:
    def __init__(self, device: torch.device, grammars=None):
        """`grammars`: structured.Grammars, the engine's (rank 0); None: no structured outputs."""
        self.device = device
        self.logprobs: dict[str, dict[int, float]] = {}  # this step's, for requests that ask (runner clears)
        # this step's prompt scores (the same): per position, ({token: log-prob, top N}, the token's rank)
        self.prompt_logprobs: dict[str, list[tuple[dict[int, float], int]]] = {}
        self.grammars = grammars

    def forget(self, request_id: str) -> None:
        if self.grammars is not None:
            self.grammars.forget(request_id)

    @staticmethod
    def noise(rows: int, vocab: int, device, seed: int | None, first_index: int) -> torch.Tensor:
        """Exp(1) draws [rows, vocab] for a request's output tokens first_index, first_index + 1,
        ...: from its seed's stream (sampling_noise.py), or torch's generator when unseeded."""
        if seed is None:
            return sampling_noise.unseeded(rows, vocab, device)
        return sampling_noise.seeded_exponentials(seed, first_index, rows, vocab, device)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """logits [num_seqs, vocab] (float32), one row per request -> one token id each, after
        the requests' own adjustments (logits_process.py: bias, banned tokens, penalties)."""
        process(logits, reqs)
        constrained = self.grammars.mask(logits, reqs) if self.grammars is not None else []
        tokens = self._draw(logits, reqs).tolist()
        want = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if want:
            self.logprobs.update(self._logprobs(logits, reqs, want, tokens))
        if constrained:
            self.grammars.accept(reqs, constrained, tokens)
        return tokens

    @torch.no_grad()
    def sample_on_device(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The token ids as a device tensor, without waiting for them (the overlapped step,
        core/overlap.py): for requests whose sampling needs no host round trip (overlap.plain)."""
        process(logits, reqs)
        return self._draw(logits, reqs)

    def _draw(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in reqs]
        greedy = logits.argmax(dim=-1)
        return greedy if all(p.greedy for p in params) else self._sample(logits, params, reqs, greedy)

    @torch.no_grad()
    def score_prompts(self, logits: torch.Tensor, scheduled: list) -> None:
        """logits at the scheduled chunks' prompt positions (ScheduledRequest.prompt_positions,
        in order): each position's next prompt token's log-prob, its rank and the request's top
        N, of the model's raw distribution (vLLM's prompt_logprobs), into self.prompt_logprobs."""
        owners = [(s.request, p) for s in scheduled for p in s.prompt_positions]
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor([req.all_token_ids[p + 1] for req, p in owners], device=lp.device)
        got = lp.gather(1, targets[:, None])
        ranks = (lp > got).sum(dim=-1).add_(1).tolist()  # 1 + the tokens more likely than it
        got = got[:, 0].tolist()
        k = max(req.sampling_params.prompt_logprobs for req, _ in owners)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, (req, p) in enumerate(owners):
            n = req.sampling_params.prompt_logprobs
            entry = {req.all_token_ids[p + 1]: got[j]}
            for t, v in zip(top_i[j][:n], top_v[j][:n]):
                entry.setdefault(t, v)
            self.prompt_logprobs.setdefault(req.request_id, []).append((entry, ranks[j]))

    @staticmethod
    def _logprobs(logits: torch.Tensor, reqs: list[Request], rows: list[int], tokens: list[int]) -> dict:
        """{request id: {sampled: log-prob, top ids: log-probs}} for the rows that ask: the
        distribution after the request's adjustments, before temperature (vLLM's processed
        logits)."""
        lp = torch.log_softmax(logits[rows], dim=-1)
        k = max(reqs[i].sampling_params.logprobs for i in rows)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        sampled = lp[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])].tolist()
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out = {}
        for j, i in enumerate(rows):
            n = reqs[i].sampling_params.logprobs
            entry = {tokens[i]: sampled[j]}
            for t, v in zip(top_i[j][:n], top_v[j][:n]):
                if v != float("-inf"):  # a token the request may not sample (a ban, a grammar) is no candidate
                    entry.setdefault(t, v)
            asked = reqs[i].sampling_params.logprob_token_ids
            if asked:  # the ids the request names, whatever their rank (-inf where it may not sample them)
                for t, v in zip(asked, lp[j, asked].tolist()):
                    entry.setdefault(t, v)
            out[reqs[i].request_id] = entry
        return out

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], reqs: list[Request],
                greedy: torch.Tensor) -> torch.Tensor:
        """The exponential race over the rows' distributions: the rows' parameters in one upload
        (RowParams), and the seeded rows' places and keys in a second when there are any."""
        n = logits.shape[0]
        rows = RowParams.of([r.sampling_row for r in reqs], logits.device)
        probs = self.probs(logits, params, rows)
        noise = sampling_noise.unseeded(*probs.shape, probs.device)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        if seeded:  # each at the index of the output token it draws now
            keys = [sampling_noise.stream_keys(params[i].seed, reqs[i].num_output_tokens) for i in seeded]
            m = len(seeded)
            ints = to_device(seeded + [k[0] for k in keys] + [k[1] for k in keys], logits.device, torch.int64)
            noise.index_copy_(0, ints[:m], sampling_noise.keyed_exponentials(ints[m:2 * m], ints[2 * m:],
                                                                             probs.shape[1]))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(rows.greedy, greedy, sampled)[:n]

    def probs(self, logits: torch.Tensor, params: list[SamplingParams], rows: RowParams | None = None) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k and top-p, then min-p.
        `params` decide on the host which of these steps any row needs; `rows` (else built here)
        are their values on the device."""
        rows = RowParams.of([p.row() for p in params], logits.device) if rows is None else rows
        logits = logits / rows.temperature[:, None]
        vocab = logits.shape[1]
        if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, rows)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):  # drop tokens below min_p x the row's top probability
            min_p = rows.min_p[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @torch.no_grad()
    def verify(self, logits: torch.Tensor, drafts: list[int], request: Request,
               argmax: list[int] | None = None) -> list[int]:
        """logits [k+1, vocab] at a request's [last token, d1..dk]: the tokens its step
        produces (accepted drafts, then one from the target; spec/decode.py). Row j draws the
        request's output token num_output_tokens + j. `argmax`: the rows' argmax if the caller
        has it (one device sync for the whole batch)."""
        params = request.sampling_params
        if params.greedy:
            return verify_greedy(argmax if argmax is not None else logits.argmax(dim=-1).tolist(), drafts)
        probs = self.probs(logits, [params] * len(logits), RowParams.of([request.sampling_row] * len(logits),
                                                                        logits.device))
        noise = self.noise(len(logits), probs.shape[1], probs.device, params.seed, request.num_output_tokens)
        return verify_sampled(probs, drafts, noise)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=logits.device, dtype=torch.float32)[None, :]
        mask = ranks >= rows.top_k[:, None]  # outside top-k (inf: none)
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays:
        # a top_p below float32's smallest, 1e-300, is 0 here)
        mask |= (probs.cumsum(dim=-1) - probs) >= rows.top_p[:, None]
        mask[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
