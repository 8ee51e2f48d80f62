"""A KV cache's layout (`KVLayout`): the one description of its bytes that two workers must agree
on to exchange blocks (transfer/base.py), that the persisted host tier records (tiers/persist.py)
and that the cache is allocated by (exec/kv_cache.py); per rank under tensor parallelism.
Importing it loads no torch (the block registry receives layouts and never touches a tensor):
what needs torch or the quantization kernels imports them when it runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..config import EngineConfig


@dataclass(frozen=True)
class KVLayout:
    """The one description of a KV cache's bytes: what two workers must agree on to exchange
    KV blocks (the wire check, transfer/base.py), what the persisted host tier records
    (tiers/persist.py), per rank under tensor parallelism. `dtype` is the values' dtype (int8,
    float8_e4m3fn or int4 for a quantized cache, whose slab is uint8), `scale_bytes` the bytes of
    scale each (token, head) row carries after them (ops/kv_quant.py)."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    scale_bytes: int = 0  # per (token, head) row: a quantized cache's scale(s) (ops/kv_quant.py)
    parts: int = 2  # rows per token and head: K and V, or one latent row (MLA)

    @property
    def block_bytes(self) -> int:
        import torch

        if self.dtype == "int4":
            values = self.head_dim // 2
        else:
            values = self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * self.parts * self.block_size * self.num_kv_heads * (values + self.scale_bytes)

    def tensor(self, num_blocks: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of the block-major tensor that holds `num_blocks` blocks of this
        layout: [num_blocks, layers, parts, block_size, kv_heads, head_dim] of the values' dtype, or
        for a quantized cache a uint8 slab whose rows hold the values, then their scale(s)."""
        import torch

        rows = (num_blocks, self.num_layers, self.parts, self.block_size, self.num_kv_heads)
        if self.scale_bytes:
            values = self.head_dim // 2 if self.dtype == "int4" else self.head_dim
            return (*rows, values + self.scale_bytes), torch.uint8
        return (*rows, self.head_dim), getattr(torch, self.dtype)

    def as_dict(self) -> dict:
        """The fields; `parts` only when it is not 2, so GQA layouts read as they always have (in
        persisted files and on the wire)."""
        d = asdict(self)
        if self.parts == 2:
            del d["parts"]
        return d

    @classmethod
    def of(cls, kv: torch.Tensor, kv_cache_dtype: str = "auto") -> KVLayout:
        """The layout of a block-major KV tensor [num_blocks, layers, parts, block_size, kv_heads,
        head_dim]; a quantized cache's uint8 slab (kv_cache_dtype int8 / fp8 / int4) holds each row's
        values and scale(s), described as such (the same as kv_layout(config))."""
        import torch

        from ..ops import kv_quant

        if kv.dim() != 6 or kv.shape[2] not in (1, 2):
            raise ValueError("KV cache must be [num_blocks, layers, parts (1 or 2), block_size, kv_heads, head_dim], "
                             f"got {tuple(kv.shape)}")
        _, layers, parts, bs, heads, dim = kv.shape
        if kv_quant.is_scaled(kv_cache_dtype):
            if kv.dtype != torch.uint8:
                raise ValueError(f"a {kv_cache_dtype} KV cache is a uint8 slab, got {kv.dtype}")
            head_dim = kv_quant.head_dim_of(kv_cache_dtype, dim)
            return cls(bs, layers, heads, head_dim, _value_dtype(kv_cache_dtype),
                       kv_quant.row_bytes(kv_cache_dtype, head_dim) - _value_bytes(kv_cache_dtype, head_dim), parts)
        return cls(bs, layers, heads, dim, str(kv.dtype).removeprefix("torch."), parts=parts)


def local_kv_heads(config: EngineConfig) -> int:
    """KV heads one rank holds (the same count on every rank of a tensor-parallel group): its share
    of the model's declared heads, or all of them when the cache is not sharded by heads."""
    from .tp import kv_head_range

    spec = config.model_config.kv_cache_spec
    if not spec.sharded:
        return spec.num_heads
    lo, hi = kv_head_range(spec.num_heads, config.tensor_parallel_size, 0)
    return hi - lo


def _value_dtype(kv_cache_dtype: str) -> str:
    from ..ops import kv_quant

    return "int4" if kv_cache_dtype == "int4" else str(kv_quant.SCALED[kv_cache_dtype][0]).removeprefix("torch.")


def _value_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    return head_dim // 2 if kv_cache_dtype == "int4" else head_dim


def kv_layout(config: EngineConfig) -> KVLayout:
    """One rank's layout, from what the model declares it caches (ModelConfig.kv_cache_spec)."""
    from ..ops import kv_quant

    mc, c = config.model_config, config.kv_cache_dtype
    spec = mc.kv_cache_spec
    d = spec.head_dim
    if kv_quant.is_scaled(c):
        return KVLayout(config.block_size, mc.num_layers, local_kv_heads(config), d, _value_dtype(c),
                        kv_quant.row_bytes(c, d) - _value_bytes(c, d), spec.parts)
    return KVLayout(config.block_size, mc.num_layers, local_kv_heads(config), d,
                    str(config.kv_dtype).removeprefix("torch."), parts=spec.parts)
