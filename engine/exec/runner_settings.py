"""What a model runner reads, and nothing else: `RunnerSettings.of(config)` takes them from a
resolved EngineConfig once, where the engine is assembled (assembly.py) or a tensor-parallel rank
starts (shard.py), and the runner, its graphs, the loader and the KV tensor's sizing read only
these fields. The scheduler's own settings (policy, chunking, the TPOT target), the tiers' files
and the speculation's proposer never reach the runner.

    the model       model (directory), model_config, torch_dtype, seed, tensor_parallel_size
    the device      torch_device
    the KV cache    cache (CacheSettings: block size, KV dtype, the memory budget), kv_dtype,
                    window (its eviction, or None), kv_offloading_size (the host tier's GiB)
    the batch       max_num_seqs, max_num_batched_tokens, max_model_len: the graphs' and the
                    scratch memory's sizes
    the kernels     use_triton, fused_ops, enforce_eager, cuda_graph_max_tokens, attention_tuning
    speculation     spec: the verification rows the decode graphs are captured for

Field names are EngineConfig's, so the helpers below the runner that size a KV layout
(base/kv_layout.py) read either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base.kv_window import KVWindow
from ..settings import AttentionTuning, CacheSettings

if TYPE_CHECKING:
    import torch

    from ..base.speculative import SpeculativeConfig
    from ..config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class RunnerSettings:
    model: str
    model_config: ModelConfig
    torch_dtype: torch.dtype
    torch_device: torch.device
    seed: int
    tensor_parallel_size: int
    cache: CacheSettings
    kv_dtype: torch.dtype
    window: KVWindow | None
    kv_offloading_size: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    use_triton: bool
    fused_ops: bool
    enforce_eager: bool
    cuda_graph_max_tokens: int
    attention_tuning: AttentionTuning
    spec: SpeculativeConfig | None

    @classmethod
    def of(cls, config: EngineConfig) -> RunnerSettings:
        """The runner's settings of `config` (resolved: its model read, its device known)."""
        if config.model_config is None:
            raise ValueError("RunnerSettings.of takes a resolved EngineConfig (EngineConfig.resolve)")
        return cls(config.model, config.model_config, config.torch_dtype, config.torch_device, config.seed,
                   config.tensor_parallel_size, CacheSettings.of(config), config.kv_dtype, KVWindow.of(config),
                   config.kv_offloading_size, config.max_num_seqs, config.max_num_batched_tokens,
                   config.max_model_len, config.use_triton, bool(config.fused_ops), config.enforce_eager,
                   config.cuda_graph_max_tokens, config.attention_tuning, config.spec)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def kv_cache_dtype(self) -> str:
        return self.cache.kv_cache_dtype
