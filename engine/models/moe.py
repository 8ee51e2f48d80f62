"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral; DeepSeek's routed experts build on it).

A router (a linear map to one logit per expert) picks each token's top-k experts by softmax
(engine/ops/moe_ref.route); every expert is a SiLU-gated MLP whose weights are fused across experts
into two tensors, gate and up rows together (`w_gate_up` [E, 2 x I, hidden]) and `w_down`
[E, hidden, I], filled from a checkpoint's per-expert tensors (`expert_targets`). The experts run
through the fused Triton kernel (engine/ops/triton_moe.py: no host sync, so CUDA graphs capture
it) when the model runs its Triton kernels, else through its torch reference (ops/moe_ref.py).

With a tensor-parallel group of N each rank holds I/N of every expert's intermediate rows (its
gate and up rows, the matching columns of down) and the whole router; the partial outputs are
summed by one all-reduce after the combine. With expert parallelism (`moe.expert_parallel`,
EngineConfig.enable_expert_parallel) each rank holds E/N experts whole, [rank x E/N, (rank + 1) x
E/N): every rank routes every token (attention is tensor-parallel, so each holds all of the
step's tokens), runs the assignments to its own experts (the others' are skipped: ops/moe_ref's
`local_ids`), and the same all-reduce sums each token's experts across the ranks. No all-to-all:
that pays where attention is data-parallel and a rank holds only its own tokens, which a
pdserve worker does not do (its data parallelism is more workers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..architectures import MoEConfig
from ..base.tp import TPGroup
from ..ops.moe_ref import moe_ref


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPGroup | None = None, use_triton: bool = False):
        super().__init__()
        self.experts = moe_ref
        self.decode = None  # the few-token path (ops/triton_moe_decode.py), with the Triton kernels
        if use_triton:  # imports Triton only when a model runs it
            from ..ops import triton_moe_decode
            from ..ops.triton_moe import moe_triton
            from ..ops.triton_moe_route import Routing

            self.experts = moe_triton
            self.decode = triton_moe_decode
            self.routing = Routing.of(moe.num_experts, moe.top_k, moe.norm_topk_prob)
        self._arrivals: torch.Tensor | None = None  # the decode router's counters, made on first use
        self.tp = tp = tp or TPGroup()
        self.moe = moe
        ep = moe.expert_parallel and tp.size > 1
        inter = moe.intermediate_size if ep else moe.intermediate_size // tp.size
        count = moe.num_experts // tp.size if ep else moe.num_experts
        # the experts this rank holds: [first, first + count) of the router's; None: all of them
        self.held = (tp.rank * count, count) if ep else None
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(count, 2 * inter, hidden_size))
        self.w_down = nn.Parameter(torch.empty(count, hidden_size, inter))
        self.fp8_block: tuple[int, int] | None = None  # hold_fp8's

    def can_hold_fp8(self, block: tuple[int, int]) -> bool:
        """Whether the experts can stay FP8 in blocks of `block`: they run the Triton kernels, and
        each expert's intermediate rows here (gate's, then up's) start on a block."""
        return self.decode is not None and self.w_down.shape[2] % block[0] == 0

    def hold_fp8(self, block: tuple[int, int]) -> None:
        """From here on (still empty) the experts' weights are e4m3 with a float32 scale per
        `block` (`w_gate_up_scale` [E, 2I / bn, H / bk], `w_down_scale` [E, H / bn, I / bk]), and
        run through the kernels' FP8 path (ops/triton_moe.Fp8Experts): the loader's choice for
        an FP8 checkpoint's experts where the model runs its Triton kernels (exec/loader.py)."""
        if not self.can_hold_fp8(block):
            raise ValueError(f"experts of {tuple(self.w_down.shape)} cannot be held in FP8 blocks of {block}")
        (bn, bk), (count, two_i, hidden), dev = block, self.w_gate_up.shape, self.w_gate_up.device
        inter = two_i // 2
        fp8 = torch.float8_e4m3fn
        self.w_gate_up = nn.Parameter(torch.empty(count, two_i, hidden, dtype=fp8, device=dev), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(count, hidden, inter, dtype=fp8, device=dev), requires_grad=False)
        self.w_gate_up_scale = nn.Parameter(torch.empty(count, two_i // bn, -(-hidden // bk), device=dev),
                                            requires_grad=False)
        self.w_down_scale = nn.Parameter(torch.empty(count, -(-hidden // bn), -(-inter // bk), device=dev),
                                         requires_grad=False)
        self.fp8_block = block

    def fp8(self):
        """The experts' block scales for the kernels (ops/triton_moe.Fp8Experts), or None."""
        if self.fp8_block is None:
            return None
        from ..ops.triton_moe import Fp8Experts

        return Fp8Experts(self.w_gate_up_scale, self.w_down_scale, self.fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if self.moe.weights_in_model_dtype else torch.float32
        if self.decode is not None and 0 < x.shape[0] <= self.decode.DECODE_TOKENS:
            out = self.decode.moe_decode_triton(x, self.gate.weight, self.w_gate_up, self.w_down, self.routing, dtype,
                                                self.arrivals(x.device), self.held, fp8=self.fp8())
            return self.tp.all_reduce(out)
        logits = F.linear(x, self.gate.weight)
        kw = {"fp8": self.fp8()} if self.fp8_block is not None else {}  # the torch reference holds no FP8
        out = self.experts(x, logits, self.w_gate_up, self.w_down, self.moe.top_k, self.moe.norm_topk_prob,
                           dtype, held=self.held, **kw)
        return self.tp.all_reduce(out)

    def arrivals(self, device) -> torch.Tensor:
        """The decode router's per-token counters on `device`: zero between its launches (made
        once, before any graph captures the layer: the engine's warm-up runs it eagerly first)."""
        if self._arrivals is None or self._arrivals.device != device:
            self._arrivals = torch.zeros(self.decode.DECODE_TOKENS, dtype=torch.int32, device=device)
        return self._arrivals

    def expert_targets(self, prefix: str, expert: int, part: str) -> list[tuple[str, slice | None, int, slice | None]]:
        """Where expert `expert`'s checkpoint tensor `part` ("gate", "up" or "down") goes on this
        rank, in the loader's form (our parameter + "[expert]", rows within it, the source dim
        sliced, this rank's slice of it); [] for an expert another rank holds (expert parallel)."""
        inter = self.w_down.shape[2]
        mine = slice(self.tp.rank * inter, (self.tp.rank + 1) * inter)
        if self.held is not None:
            first, count = self.held
            if not first <= expert < first + count:
                return []
            expert, mine = expert - first, None  # whole, at its place among this rank's
        if part == "gate":
            return [(f"{prefix}.w_gate_up[{expert}]", slice(0, inter), 0, mine)]
        if part == "up":
            return [(f"{prefix}.w_gate_up[{expert}]", slice(inter, 2 * inter), 0, mine)]
        return [(f"{prefix}.w_down[{expert}]", None, 1, mine)]
