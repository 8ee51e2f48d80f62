"""Eviction for long sessions: `kv_sink_tokens`, `kv_window_tokens`, `kv_evict`.

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

Heavy hitters (`kv_evict="h2o"`, H2O; docs/design/h2o.md): the same budget, the same trigger and
the same count of blocks dropped, but which ones differs. The last half of the window (whole
blocks, `recent`) always stays; the blocks dropped are the n with the least accumulated
attention (`Request.kv_scores`: per block, the softmax mass every query of every layer and head
put on its tokens, which the attention adds up as it runs: models/attention.py) among the whole
blocks between the sinks and that recent half. Dropping a middle block moves every later block
forward: each later run of blocks is rotated by the tokens dropped before it (one KVShift per
distance). A block is the unit: its 16 positions stay one run (prefix hashes, handoffs, tiers
and the block copy rely on it), so a block with one heavy token stays whole.

The window needs exclusive blocks and unquantized keys: prefix caching, the host tier and the
quantized KV dtypes are refused with it, and it runs without overlapped scheduling,
speculative decoding or tensor parallelism. A prefill/decode handoff carries a request's
blocks by sequence position, so the cluster runs it in colocated mode only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request
    from ..core.scheduler import ScheduledRequest


@dataclass(frozen=True)
class KVShift:
    """Keys of `block_ids` to rotate back by `distance` positions before the next forward."""

    block_ids: list[int]
    distance: int


def settle_window(config: EngineConfig) -> None:
    """Bad values name the setting (ValueError); a window turns off what it cannot run with: prefix
    caching and overlapped scheduling (a block's keys move with it: never shared)."""
    check_window(config)
    if config.kv_window_tokens is not None:
        config.enable_prefix_caching = config.async_scheduling = False


def check_window(config: EngineConfig) -> None:
    """Bad values name the setting (ValueError)."""
    sink, window, bs = config.kv_sink_tokens, config.kv_window_tokens, config.block_size
    if config.kv_evict not in ("window", "h2o"):
        raise ValueError(f"kv_evict must be window or h2o, got {config.kv_evict!r}")
    if config.kv_evict == "h2o" and window is not None and window < 2 * bs:
        raise ValueError(f"kv_window_tokens must be >= 2 blocks ({2 * bs}) with kv_evict h2o: half stays the "
                         f"recent window, half the heavy hitters; got {window}")
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise ValueError(f"kv_sink_tokens must be an integer >= 0, got {sink!r}")
    if window is None:
        if sink:
            raise ValueError("kv_sink_tokens keeps the first tokens of a window: set kv_window_tokens too")
        if config.kv_evict != "window":
            raise ValueError(f"kv_evict {config.kv_evict!r} chooses what a budget keeps: set kv_window_tokens "
                             "(the budget) too")
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
    recent: int | None = None  # heavy hitters (h2o): the last tokens always kept (whole blocks); None: window

    @classmethod
    def of(cls, config: EngineConfig) -> KVWindow | None:
        if config.kv_window_tokens is None:
            return None
        bs, window = config.block_size, config.kv_window_tokens
        recent = window // 2 // bs * bs if config.kv_evict == "h2o" else None
        return cls(bs, -(-config.kv_sink_tokens // bs), window, max(1, window // 4 // bs), recent)

    @property
    def scores(self) -> bool:
        """Whether eviction reads the attention's scores (heavy hitters)."""
        return self.recent is not None

    @property
    def max_cache_tokens(self) -> int:
        """What a request can hold before a step: sinks, the window, a chunk not yet evicted and
        the partial block at the window's start."""
        return (self.sink_blocks + self.chunk + 1) * self.block_size + self.window

    def trim(self, kv: KVCacheManager, req: Request) -> list[KVShift]:
        """Frees the blocks a request is over its budget by (a chunk at least; nothing below), and
        returns the rotations its later computed blocks need."""
        bs, s = self.block_size, self.sink_blocks
        cached = req.num_computed_tokens - req.kv_shift
        n = (cached - self.window) // bs - s
        if n < self.chunk:
            return []
        blocks = kv.req_blocks[req.request_id]
        if self.recent is None:  # the oldest after the sinks
            drop = list(range(s, s + n))
        else:  # the least attended between the sinks and the recent half (ties: the older)
            scores = np.pad(req.kv_scores, (0, len(blocks) - len(req.kv_scores)))
            drop = sorted((s + np.argsort(scores[s:(cached - self.recent) // bs], kind="stable")[:n]).tolist())
            req.kv_scores = np.delete(scores, drop)
        gone = set(drop)
        kv.pool.free(reversed([blocks[j] for j in drop]))
        computed = -(-cached // bs)  # blocks holding computed keys (the last may be partial)
        shifts: dict[int, list[int]] = {}
        for j in range(drop[0] + 1, computed):  # each later kept block moves by the tokens dropped before it
            if j not in gone:
                shifts.setdefault(bs * sum(d < j for d in drop), []).append(blocks[j].block_id)
        kv.req_blocks[req.request_id] = [b for j, b in enumerate(blocks) if j not in gone]
        kv.req_published.pop(req.request_id, None)  # its blocks moved: published from the first again
        req.kv_shift += n * bs
        return [KVShift(ids, d) for d, ids in shifts.items()]


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


def add_scores(batch: list[ScheduledRequest], scores: torch.Tensor) -> None:
    """Adds a step's attention mass per block ([sequences, kv heads, max_blocks], the batch's order;
    a block's is its sum over the kv heads) to each request's `kv_scores` (one host copy a step)."""
    rows = scores.sum(dim=1).cpu().numpy()
    for s, row in zip(batch, rows):
        n, req = len(s.block_ids), s.request
        if len(req.kv_scores) < n:
            req.kv_scores = np.pad(req.kv_scores, (0, n - len(req.kv_scores)))
        req.kv_scores[:n] += row[:n]
