"""Sampling noise that is a pure function of (seed, output index, token id).

The sampler draws a token by the exponential race: argmax over the vocabulary of p / E with
E ~ Exp(1) per token, which picks token v with probability p(v). For a seeded request E comes
from here: a counter-based hash (as JAX's and cuRAND's Philox streams are keyed and offset)
of the request's seed, the index of the output token being drawn and the token id, so the
same request draws the same noise for its i-th token wherever and whenever it is drawn:

- after a prefill/decode handoff (the decode worker draws token 1 onward, at index 1),
- in hybrid placement's local prefill or the prefill pool, on a retry on another worker,
  after a preemption and recompute, after a role switch,
- in speculative verification, which draws row j of a request's step at index i + j and
  keeps a draft exactly when that draw equals it (for one-hot drafts this is rejection
  sampling: the draft survives with probability p(d), and a rejected position's token is
  distributed as p without d).

Unseeded rows take torch's exponential_ (no per-request work). The hash is lowbias32
(C. Wellons' integer hash search) in int64 arithmetic with 32-bit products split in two
halves, so no intermediate passes 2^63 and CPU and CUDA compute the same bits; the uniform
takes the top 23 bits as an odd numerator over 2^24, exact in float32 and never 0 or 1.
"""

from __future__ import annotations

import torch

from ..base.host_to_device import to_device

M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2^32 for x in [0, 2^32) (an int64 tensor or an int), c a 32-bit constant."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix(x):
    """lowbias32: a 32-bit integer hash with low bias (tensor or int)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_keys(seed: int, index: int) -> tuple[int, int]:
    """The two 32-bit keys of a seed's draw at one output index."""
    s = seed & ((1 << 64) - 1)  # a negative seed: its two's complement
    a = _mix(_mix((s & M32) ^ 0x9E3779B9) ^ (s >> 32))
    b = _mix(a ^ _mix(index & M32) ^ 0x85EBCA6B)
    return _mix(b ^ (index >> 32)), _mix(b ^ 0xC2B2AE35)


def unseeded(rows: int, vocab: int, device) -> torch.Tensor:
    """[rows, vocab] Exp(1) draws from torch's generator, floored at float32's smallest normal
    (a draw of 0 would make a masked token's 0 / 0 win the argmax)."""
    return torch.empty(rows, vocab, device=device).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)


def exponentials(keys: list[tuple[int, int]], vocab: int, device) -> torch.Tensor:
    """[len(keys), vocab] float32 Exp(1) draws, row r a pure function of keys[r] and the
    token id."""
    ka = to_device([k[0] for k in keys], device, torch.int64)
    kb = to_device([k[1] for k in keys], device, torch.int64)
    return keyed_exponentials(ka, kb, vocab)


def keyed_exponentials(ka: torch.Tensor, kb: torch.Tensor, vocab: int) -> torch.Tensor:
    """exponentials() of keys already on the device: int64 [rows] each."""
    v = torch.arange(vocab, dtype=torch.int64, device=ka.device)[None, :]
    return -torch.log(uniform(_mix(_mix((v + ka[:, None]) & M32) ^ kb[:, None])))


def uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms in (0, 1): the odd numerators 1, 3, .., 2^24 - 1 over
    2^24 (the top 23 bits), each exact in float32, so none rounds to 1 (an E of 0 would make a
    masked token's 0 / E a NaN that wins the argmax)."""
    return ((h >> 9) * 2 + 1).to(torch.float32) * (1.0 / (1 << 24))


def seeded_exponentials(seed: int, first_index: int, rows: int, vocab: int, device) -> torch.Tensor:
    """A seed's draws at output indices first_index .. first_index + rows - 1."""
    return exponentials([stream_keys(seed, first_index + j) for j in range(rows)], vocab, device)
