"""Per-request sampling over a batch of logits: greedy, temperature, top-k, top-p, seed.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws
from p exactly and lets each seeded request take its noise from its own generator,
so a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams
from .spec_decode import verify_greedy, verify_sampled


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 request_ids: list[str], banned: list[tuple[int, ...]] | None = None) -> list[int]:
        """logits [num_seqs, vocab] (float32) -> one token id per sequence. `banned[i]`: token
        ids row i may not sample (EOS and stop ids before min_tokens), masked to -inf."""
        if banned and any(banned):
            rows = [i for i, ids in enumerate(banned) for _ in ids]
            cols = [t for ids in banned for t in ids]
            idx = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device, non_blocking=True)
            logits[idx[0], idx[1]] = float("-inf")
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        n = logits.shape[0]
        probs = self.probs(logits, params)
        noise = torch.empty_like(probs)
        for i, (p, rid) in enumerate(zip(params, request_ids)):
            gen = self._generator(rid, p.seed) if p.seed is not None else None
            noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled).tolist()[:n]

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k and top-p."""
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                             device=logits.device, dtype=torch.float32)
        logits = logits / temps[:, None]
        top_ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = self._top_k_top_p(logits, top_ks, top_ps)
        return logits.softmax(dim=-1)

    @torch.no_grad()
    def verify(self, logits: torch.Tensor, drafts: list[int], params: SamplingParams, request_id: str,
               argmax: list[int] | None = None) -> list[int]:
        """logits [k+1, vocab] at a request's [last token, d1..dk]: the tokens its step
        produces (accepted drafts, then one from the target; spec_decode.py). `argmax`: the
        rows' argmax if the caller has it (one device sync for the whole batch)."""
        if params.greedy:
            return verify_greedy(argmax if argmax is not None else logits.argmax(dim=-1).tolist(), drafts)
        gen = self._generator(request_id, params.seed) if params.seed is not None else None
        return verify_sampled(self.probs(logits, [params] * len(logits)), drafts, gen)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor(top_ks, device=logits.device)[:, None]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        mask = ranks >= k  # outside top-k
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        p = torch.tensor(top_ps, device=logits.device)[:, None]
        # drop a token when the mass before it already reaches top_p (the first always stays)
        mask |= (probs.cumsum(dim=-1) - probs) >= p
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
