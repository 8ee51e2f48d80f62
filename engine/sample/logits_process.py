"""What a request does to its logits before sampling (vLLM's order and meaning):

    allowed_token_ids   -inf for every other token (vLLM's)
    logit_bias          added to the named tokens' logits (OpenAI: -100..100; -100 bans, 100
                        all but forces)
    banned              -inf for the tokens the request may not sample yet (min_tokens:
                        EOS and stop ids; Request.banned_token_ids)
    repetition_penalty  a token seen in the prompt or the output: logit / p if positive,
                        logit x p if not (p > 1 discourages repeats)
    frequency_penalty   minus f x (times the token occurs in the output)
    presence_penalty    minus r if it occurs in the output at all
    (then the sampler: greedy argmax, or temperature, min_p, top-k, top-p)

Applied in place to the rows of the requests that ask for any of it, as batched tensor ops;
a batch where none does costs one Python check per row. Greedy requests see them too (an
argmax of the adjusted logits). Speculative decoding leaves such requests out (their drafts'
verification would need the same adjustment at every drafted position).
"""

from __future__ import annotations

import torch

from ..base.host_to_device import to_device
from ..core.request import Request


def adjusts(req: Request) -> bool:
    return req.sampling_params.adjusts_logits or bool(req.banned_token_ids())


def one_token_steps(req: Request) -> bool:
    """No speculation for this request: its logits are adjusted (bias, bans, penalties, a
    grammar), or it wants log-probs per token (verification yields several tokens from one
    sampler call)."""
    p = req.sampling_params
    return adjusts(req) or p.logprobs is not None or p.structured_outputs is not None


def process(logits: torch.Tensor, reqs: list[Request]) -> None:
    """logits [len(reqs), vocab], float32, adjusted in place."""
    rows = [i for i, r in enumerate(reqs) if adjusts(r)]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    for i in rows:
        allowed = reqs[i].sampling_params.allowed_token_ids
        if allowed is not None:
            keep = torch.tensor([t for t in allowed if t < vocab], dtype=torch.int64, device=dev)
            logits[i] = torch.full_like(logits[i], float("-inf")).index_copy_(0, keep, logits[i, keep])
    _add(logits, [(i, t, b) for i in rows for t, b in (reqs[i].sampling_params.logit_bias or {}).items()
                  if t < vocab], dev)
    _add(logits, [(i, t, float("-inf")) for i in rows for t in reqs[i].banned_token_ids()], dev, assign=True)
    pen = [i for i in rows if reqs[i].sampling_params.penalized]
    if pen:
        _penalize(logits, [reqs[i] for i in pen], torch.tensor(pen, device=dev))


def _add(logits: torch.Tensor, entries: list[tuple[int, int, float]], dev, assign: bool = False) -> None:
    if not entries:
        return
    r, c, v = zip(*entries)
    idx = (to_device(r, dev, torch.int64), to_device(c, dev, torch.int64))
    vals = to_device(v, dev, logits.dtype)
    logits.index_put_(idx, vals, accumulate=not assign)


def _penalize(logits: torch.Tensor, reqs: list[Request], rows: torch.Tensor) -> None:
    dev, vocab = logits.device, logits.shape[1]
    n = len(reqs)
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=dev)  # output occurrences
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)  # prompt or output
    for j, r in enumerate(reqs):
        out = torch.tensor([t for t in r.output_token_ids if t < vocab], dtype=torch.int64, device=dev)
        counts[j].scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        if r.sampling_params.repetition_penalty != 1.0:
            seen[j, torch.tensor([t for t in r.prompt_token_ids if t < vocab], dtype=torch.int64, device=dev)] = True
    seen |= counts > 0
    ps = [r.sampling_params for r in reqs]
    rep = torch.tensor([p.repetition_penalty for p in ps], dtype=logits.dtype, device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in ps], dtype=logits.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in ps], dtype=logits.dtype, device=dev)[:, None]
    x = logits[rows]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).to(x.dtype)
    logits[rows] = x
