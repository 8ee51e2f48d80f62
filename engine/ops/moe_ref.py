"""The mixture-of-experts computation in plain torch: the oracle the fused-MoE kernel is tested
against, and the path on CPU.

    fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, hidden]

x [T, hidden]; w_gate_up [E, 2 x I, hidden] (each expert's gate rows, then its up rows);
w_down [E, hidden, I]; topk_weights / topk_ids [T, k]. Each expert runs once on the tokens that
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


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
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
            renormalize: bool, weights_dtype: torch.dtype) -> torch.Tensor:
    """A sparse layer's experts from its router logits [T, E]: `route`, then `fused_moe_ref`."""
    weights, ids = route(logits, top_k, renormalize, weights_dtype)
    return fused_moe_ref(x, w_gate_up, w_down, weights, ids)
