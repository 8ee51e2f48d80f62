"""Verifying draft tokens against the target's distribution at their positions (the
sampler's part of speculative decoding, decode.py)."""

from __future__ import annotations

import torch


def verify_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """The target's argmax at [last token, d1..dk] (k+1 ids) -> the tokens the step produces."""
    out = []
    for i, d in enumerate(drafts):
        out.append(target[i])
        if target[i] != d:
            return out
    out.append(target[len(drafts)])
    return out


def verify_sampled(probs: torch.Tensor, drafts: list[int], noise: torch.Tensor) -> list[int]:
    """probs [k+1, vocab]: the target's (after temperature / top-k / top-p); noise [k+1, vocab]:
    Exp(1) draws, row j the request's draw for the token at that row (sampler.Sampler.noise).
    Each row draws its token by the exponential race (argmax p / E), as plain sampling would at
    that index; d_j is kept while the draw equals it, and the first draw that differs ends the
    step (after k acceptances, row k's draw is the bonus token). Against one-hot drafts this is
    rejection sampling: d_j survives with probability p_j(d_j), and a rejected row's token is
    distributed as p_j without d_j, renormalized. A seeded request draws the same tokens as it
    would without speculation."""
    draws = (probs / noise).argmax(dim=-1).tolist()
    return verify_greedy(draws, drafts)
