"""What the engine uses of a model, and nothing else (`CausalLM`): the model runner, the CUDA
graphs and the loader reach a model only through these members. A family (engine/models/<file>.py,
named by its architectures' rows in engine/architectures.py) implements them; the registered
families are checked against this protocol in tests/engine/test_model_protocol.py.

    forward(ids, positions, kv_caches, meta)   hidden states [T, hidden]
    piece(i, positions, x, residual)           the work between two attentions (piecewise graphs)
    compute_logits(hidden)                     logits [T, vocab], gathered across TP ranks
    attention(i)                               layer i's attention backend: store, warm_up, capturable
    num_layers                                 how many attentions (pieces: num_layers + 1)
    rotary                                     the rope tables (cos, sin) the KV window's key rotation reads
    embed_tokens, lm_head                      tied again after the loader allocates them
    shard_targets(hf_name), expected_elements  where each checkpoint tensor goes on this rank
    float32_params()                           parameters kept in float32 whatever the dtype
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CausalLM(Protocol):
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    rotary: nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta) -> torch.Tensor: ...

    def piece(self, i: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None): ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention(self, i: int) -> nn.Module: ...

    @property
    def num_layers(self) -> int: ...

    def shard_targets(self, hf_name: str) -> list[tuple[str, slice | None, int, slice | None]]: ...

    def expected_elements(self, name: str, p: torch.Tensor) -> int: ...

    def float32_params(self) -> set[str]: ...
