"""Routing a mixture-of-experts layer in Triton: each token's top-k experts from its router logits.

    route_triton(logits, top_k, renormalize, out_dtype, moe=None, correction_bias=None)
                -> (weights [T, k], ids [T, k] int32, (counts [E], ranks [T x k]))

One program per token computes the scores in fp32, DeepSeek's group limit where its MoEConfig
asks for it, the top-k by repeated argmax (highest first) and the weights (`_route_row`, shared
with the decode path's router in ops/triton_moe_decode.py), and ranks each assignment among its
expert's with atomics: what ops/triton_moe.align needs, so the alignment skips its own ranking
launch. ops/moe_ref.route and route_grouped are the torch reference it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _group_keep(choice, offs, live, E, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                TOP2: tl.constexpr):
    # DeepSeek's group limit: each group of E / N_GROUP experts scored by its best choice (TOP2: the
    # sum of its two best), the TOPK_GROUP best groups kept; -> which experts are in a kept group
    grp = offs // (E // N_GROUP)
    gs = tl.arange(0, G_PAD)
    score = tl.full([G_PAD], float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        vals = tl.where((grp == g) & live, choice, float("-inf"))
        best = tl.max(vals, 0)
        if TOP2:
            best += tl.max(tl.where(offs == tl.argmax(vals, 0), float("-inf"), vals), 0)
        score = tl.where(gs == g, best, score)
    kept = tl.zeros([G_PAD], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(score, 0)
        kept = tl.where(gs == g, 1, kept)
        score = tl.where(gs == g, float("-inf"), score)
    return tl.sum(tl.where(grp[:, None] == gs[None, :], kept[None, :], 0), axis=1) > 0


@triton.jit
def _route_row(logits, bias_ptr, offs, live, E, scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
               RENORM: tl.constexpr, ROUTING: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr,
               TOPK_GROUP: tl.constexpr, RANKED: tl.constexpr = False):
    """One token's fp32 logits [E_PAD] (-inf past E) -> its top-k (ids, weights) [K_PAD]: the scores
    (ROUTING 0 / 1: softmax, 2: sigmoid with the correction bias added to choose), DeepSeek's group
    limit (1, 2), the top-k (highest first; RANKED: by each expert's rank in one pass, else by k
    rounds of argmax), the weights renormalized and scaled."""
    if ROUTING == 2:
        p = tl.sigmoid(logits)
        choice = tl.where(live, p + tl.load(bias_ptr + offs, mask=live, other=0.0), float("-inf"))
    else:
        p = tl.exp(logits - tl.max(logits, 0))
        p = p / tl.sum(p, 0)
        choice = p
    if ROUTING != 0:  # the experts of groups not kept: softmax's scores 0, the sigmoid choice -inf (as torch)
        keep = _group_keep(choice, offs, live, E, N_GROUP, G_PAD, TOPK_GROUP, ROUTING == 2)
        choice = tl.where(keep, choice, 0.0 if ROUTING == 1 else float("-inf"))
    ks = tl.arange(0, K_PAD)
    if RANKED:  # one pass: each expert's rank (higher first, the lower index on ties: argmax's order)
        beats = (choice[None, :] > choice[:, None]) | ((choice[None, :] == choice[:, None])
                                                       & (offs[None, :] < offs[:, None]))
        rank = tl.sum(beats.to(tl.int32), axis=1)
        chosen = (rank[None, :] == ks[:, None]) & (ks < TOP_K)[:, None]  # [K_PAD, E_PAD]
        top_ids = tl.sum(tl.where(chosen, offs[None, :], 0), axis=1).to(tl.int32)
        top_p = tl.sum(tl.where(chosen, p[None, :], 0.0), axis=1)
    else:  # k rounds of argmax: registers for E_PAD values, not E_PAD squared
        top_ids = tl.zeros([K_PAD], tl.int32)
        top_p = tl.zeros([K_PAD], tl.float32)
        for j in tl.static_range(TOP_K):
            i = tl.argmax(choice, 0)
            top_ids = tl.where(ks == j, i.to(tl.int32), top_ids)
            top_p = tl.where(ks == j, tl.sum(tl.where(offs == i, p, 0.0), 0), top_p)
            choice = tl.where(offs == i, float("-inf"), choice)
    if RENORM:
        top_p = top_p / (tl.sum(top_p, 0) + 1e-20)
    return top_ids, top_p * scale


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, rank_ptr, counts_ptr, E, stride_l, scale,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr,
                      ROUTING: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr):
    # one program per token: its top-k (_route_row) and each assignment's rank among its expert's
    # (the k atomics issued together, not one round trip each)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    live = offs < E
    logits = tl.load(logits_ptr + t * stride_l + offs, mask=live, other=float("-inf")).to(tl.float32)
    top_ids, top_p = _route_row(logits, bias_ptr, offs, live, E, scale, TOP_K, K_PAD, RENORM, ROUTING, N_GROUP,
                                G_PAD, TOPK_GROUP)
    ks = tl.arange(0, K_PAD)
    live_k = ks < TOP_K
    tl.store(w_ptr + t * TOP_K + ks, top_p.to(w_ptr.dtype.element_ty), mask=live_k)
    tl.store(ids_ptr + t * TOP_K + ks, top_ids, mask=live_k)
    tl.store(rank_ptr + t * TOP_K + ks, tl.atomic_add(counts_ptr + top_ids, 1, mask=live_k), mask=live_k)


_ROUTINGS = {"softmax": 0, "softmax_group": 1, "sigmoid_group": 2}


@dataclass(frozen=True)
class Routing:
    """How a layer's router turns logits into top-k: plain softmax (Qwen3-MoE, Mixtral) or, from a
    MoEConfig, DeepSeek's (ops/moe_ref.route_grouped), as the routing kernels' constants."""

    top_k: int
    renormalize: bool
    kind: int = 0  # _ROUTINGS
    groups: int = 1
    topk_group: int = 1
    scale: float = 1.0

    @classmethod
    def of(cls, num_experts: int, top_k: int, renormalize: bool, moe=None, correction_bias=None) -> Routing:
        kind = _ROUTINGS[moe.routing] if moe is not None else 0
        groups = moe.n_group if kind else 1
        if kind and num_experts % groups:
            raise ValueError(f"{num_experts} experts do not split into {groups} groups")
        if kind == 2 and (correction_bias is None or correction_bias.shape != (num_experts,)):
            raise ValueError(f"sigmoid_group routing needs the correction bias [{num_experts}]")
        return cls(top_k, renormalize, kind, groups, moe.topk_group if kind else 1,
                   moe.routed_scaling_factor if moe is not None else 1.0)

    def consts(self) -> dict:
        """The routing kernels' constexpr arguments (after E_PAD)."""
        return dict(TOP_K=self.top_k, K_PAD=triton.next_power_of_2(self.top_k), RENORM=self.renormalize,
                    ROUTING=self.kind, N_GROUP=self.groups, G_PAD=max(2, triton.next_power_of_2(self.groups)),
                    TOPK_GROUP=self.topk_group)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, moe=None,
                 correction_bias: torch.Tensor | None = None):
    """ops/moe_ref.route in one launch, which also ranks each assignment among its expert's:
    (weights [T, k] in out_dtype, ids [T, k] int32, the Alignment's counts and ranks). `moe` (a
    MoEConfig): DeepSeek's router instead, ops/moe_ref.route_grouped (its routing, groups and
    scaling factor; `correction_bias` [E] float32 for sigmoid_group)."""
    T, E = logits.shape
    routing = Routing.of(E, top_k, renormalize, moe, correction_bias)
    weights = torch.empty(T, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    rank = torch.empty(T * top_k, dtype=torch.int32, device=logits.device)
    counts = torch.zeros(E, dtype=torch.int32, device=logits.device)
    if T:
        _moe_route_kernel[(T,)](logits, logits if correction_bias is None else correction_bias, weights, ids, rank,
                                counts, E, logits.stride(0), routing.scale, E_PAD=triton.next_power_of_2(E),
                                **routing.consts())
    return weights, ids, (counts, rank)
