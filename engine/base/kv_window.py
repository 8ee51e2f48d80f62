"""Sink + window eviction for long sessions (StreamingLLM): `kv_sink_tokens`, `kv_window_tokens`.

A request keeps its first blocks (the attention sinks: `kv_sink_tokens` rounded up to whole
blocks) and at least its last `kv_window_tokens` tokens; the blocks between them are freed as
the request grows, so a conversation longer than the KV budget, or than max_model_len, goes on
with bounded memory. Positions are the tokens' places in the cache, as StreamingLLM assigns
them: the first token after the sinks of a request that dropped d tokens sits at position
sink_tokens, not sink_tokens + d, so the distances a query sees stay within what the model
was trained on.

Lifecycle, per running request before each step (Scheduler._schedule -> KVWindow.trim):
  1. count the non-sink blocks wholly older than the window (cache tokens computed so far
     minus `window`); below `chunk` blocks nothing happens;
  2. free them, drop them from the request's block list and add their tokens to
     `request.kv_shift` (sequence index = cache position + kv_shift after the sinks);
  3. return a `KVShift`: the request's later computed blocks and the distance d. The runner
     applies it before the step's forward (`rotate_keys`): keys are stored rotated by their
     position, so each later key is rotated by -d (RoPE's R(p - d) = R(-d) R(p)), which is
     what recomputing it at its new position would give.
Why `chunk` (a quarter of the window): each rotation rounds the keys again in bf16; evicting
a quarter window at a time bounds a key's rotations to about four and the cache to
sinks + window + chunk + one step's tokens.

The window needs exclusive blocks and unquantized keys: prefix caching, the host tier and the
quantized KV dtypes are refused with it, and it runs without overlapped scheduling,
speculative decoding or tensor parallelism. A prefill/decode handoff carries a request's
blocks by sequence position, so the cluster runs it in colocated mode only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request


@dataclass(frozen=True)
class KVShift:
    """Keys of `block_ids` to rotate back by `distance` positions before the next forward."""

    block_ids: list[int]
    distance: int


def check_window(config: EngineConfig) -> None:
    """Bad values name the setting (ValueError)."""
    sink, window, bs = config.kv_sink_tokens, config.kv_window_tokens, config.block_size
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"kv_sink_tokens must be an integer >= 0, got {sink!r}")
    if window is None:
        if sink:
            raise ValueError("kv_sink_tokens keeps the first tokens of a window: set kv_window_tokens too")
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < bs:
        raise ValueError(f"kv_window_tokens must be an integer >= the block size ({bs}): the window is kept "
                         f"in whole blocks; got {window!r}")
    if config.kv_cache_dtype != "auto":
        raise ValueError("kv_window_tokens rotates cached keys as the window moves: it needs kv_cache_dtype "
                         f"'auto', got {config.kv_cache_dtype!r}")
    for name, on in (("kv_offloading_size", config.kv_offloading_size), ("speculative_config",
                                                                          config.speculative_config),
                     ("tensor_parallel_size > 1", config.tensor_parallel_size != 1)):
        if on:
            raise ValueError(f"kv_window_tokens does not run with {name}")


def check_window_mode(config: EngineConfig, mode: str) -> None:
    """A cluster's mode: the window runs colocated only."""
    if config.kv_window_tokens is not None and mode != "colocated":
        raise ValueError("kv_window_tokens runs in colocated mode: a handoff carries a request's blocks by "
                         f"sequence position, and the window moves them (engine/base/kv_window.py); got mode {mode!r}")


@dataclass(frozen=True)
class KVWindow:
    block_size: int
    sink_blocks: int
    window: int  # tokens kept at least
    chunk: int  # blocks evicted at a time, at least

    @classmethod
    def of(cls, config: EngineConfig) -> KVWindow | None:
        if config.kv_window_tokens is None:
            return None
        bs = config.block_size
        return cls(bs, -(-config.kv_sink_tokens // bs), config.kv_window_tokens,
                   max(1, config.kv_window_tokens // 4 // bs))

    @property
    def max_cache_tokens(self) -> int:
        """What a request can hold before a step: sinks, the window, a chunk not yet evicted and
        the partial block at the window's start."""
        return (self.sink_blocks + self.chunk + 1) * self.block_size + self.window

    def trim(self, kv: KVCacheManager, req: Request) -> KVShift | None:
        bs = self.block_size
        cached = req.num_computed_tokens - req.kv_shift
        n = (cached - self.window) // bs - self.sink_blocks
        if n < self.chunk:
            return None
        blocks = kv.req_blocks[req.request_id]
        s = self.sink_blocks
        kv.pool.free(reversed(blocks[s:s + n]))
        kv.req_blocks[req.request_id] = blocks = blocks[:s] + blocks[s + n:]
        req.kv_shift += n * bs
        later = blocks[s:-(-(cached - n * bs) // bs)]
        return KVShift([b.block_id for b in later], n * bs) if later else None


def rotate_keys(kv_views: list, rotary, shifts: list[KVShift]) -> None:
    """Rotates the keys of each shift's blocks back by its distance, every layer (K caches
    [num_blocks, block_size, kv_heads, head_dim]; rotate_half RoPE)."""
    for shift in shifts:
        ids = torch.tensor(shift.block_ids, device=kv_views[0][0].device)
        cos, sin = rotary.cos[shift.distance], rotary.sin[shift.distance]
        for k_cache, _ in kv_views:
            k = k_cache[ids].float()
            half = k.shape[-1] // 2
            k_half = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
            k_cache[ids] = (k * cos - k_half * sin).to(k_cache.dtype)
