"""The mixture-of-experts computation in plain torch: the oracle the fused-MoE kernel is tested
against, and the path on CPU.

    fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, hidden]

x [T, hidden]; w_gate_up [E, 2 x I, hidden] (each expert's gate rows, then its up rows);
w_down [E, hidden, I]; topk_weights / topk_ids [T, k] (an id E: an expert another rank holds,
skipped; `local_ids`). Each expert runs once on the tokens that
chose it (SiLU(gate) x up, then down), its rows scaled by their top-k weight and added into the
output in expert order, as Hugging Face's expert loop does, so float32 outputs match its bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype):
    """Softmax over the router's logits (float32), the top_k experts of each token and their
    weights (renormalized to sum to 1 when `renormalize`), the weights in `out_dtype`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def route_grouped(logits: torch.Tensor, moe, correction_bias: torch.Tensor | None = None):
    """DeepSeek's router over float32 logits [T, E] (MoEConfig.routing): the top_k experts of
    each token and their float32 weights, scaled by routed_scaling_factor.

        softmax        softmax, the top_k (V2's greedy; never renormalized)
        softmax_group  softmax; the topk_group groups of the n_group with the best single
                       probability; the top_k of their experts (V2's group_limited_greedy)
        sigmoid_group  sigmoid scores; scores + correction_bias choose: the topk_group groups by
                       the sum of their two best, then the top_k of their experts; the weights
                       are the chosen experts' scores, renormalized with norm_topk_prob (V3)"""
    t, e = logits.shape
    if moe.routing == "softmax":
        weights, ids = torch.topk(logits.softmax(-1, dtype=torch.float32), moe.top_k, dim=-1, sorted=False)
        return weights * moe.routed_scaling_factor, ids
    grouped = (t, moe.n_group, e // moe.n_group)
    if moe.routing == "sigmoid_group":
        scores = logits.sigmoid()
        choice = scores + correction_bias
        group_scores = choice.view(grouped).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        scores = choice = logits.softmax(-1, dtype=torch.float32)
        group_scores = scores.view(grouped).max(dim=-1).values
    group_idx = torch.topk(group_scores, moe.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()[..., None].expand(grouped).reshape(t, e)
    if moe.routing == "sigmoid_group":
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), moe.top_k, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, ids


def local_ids(ids: torch.Tensor, held: tuple[int, int] | None) -> torch.Tensor:
    """The router's expert ids [T, k] as indices into a rank's experts `held` = (first, count)
    (expert parallelism): ids - first, and `count` (no expert here: skipped) for the experts other
    ranks hold; `ids` themselves when every expert is here (held None). On the device, no sync."""
    if held is None:
        return ids
    first, count = held
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """An id equal to the number of experts (local_ids' "not here") contributes nothing."""
    out = torch.zeros_like(x)
    num_experts = w_gate_up.shape[0]
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=x.device)
    hit[topk_ids.flatten()] = True
    for e in hit[:num_experts].nonzero().flatten().tolist():
        tok, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[tok], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * topk_weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def moe_ref(x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
            renormalize: bool, weights_dtype: torch.dtype, held: tuple[int, int] | None = None) -> torch.Tensor:
    """A sparse layer's experts from its router logits [T, E]: `route`, then `fused_moe_ref`
    (`held`: the experts this rank holds, expert parallel: the others' assignments skipped)."""
    weights, ids = route(logits, top_k, renormalize, weights_dtype)
    return fused_moe_ref(x, w_gate_up, w_down, weights, local_ids(ids, held))
