"""The KV-cache tensor: block-major, so one block of all layers is contiguous.

    kv [num_blocks, num_layers, parts, block_size, num_kv_heads, head_dim]

`parts` is 2 (K and V) for GQA models, 1 for a latent cache (MLA: one row per token and layer,
the keys' and the values' source; architectures.KVCacheSpec).

Why block-major: a request's KV handoff gathers its blocks with one index_select
into a contiguous staging buffer and sends it as one message (docs/architecture.md, section 4);
with layer-major storage the same gather would touch num_layers x 2 strided regions
per block. The attention kernels read per-layer strided views kv[:, l, 0] / kv[:, l, 1]
(a latent cache: kv[:, l, 0] alone) of shape [num_blocks, block_size, num_kv_heads, head_dim].
Quantized KV ("int8", "fp8") stores each row's float32 scale after it in the same slab, "int4"
packed nibbles and a float16 scale per 32 values (ops/kv_quant.py).
"""

from __future__ import annotations

import gc
import math
import mmap
import os
import weakref

import torch

from ..base.kv_layout import KVLayout
from ..ops import kv_quant
from ..settings import CacheSettings
from .runner_settings import RunnerSettings


def activation_bytes(settings: RunnerSettings, graph_tokens: int = 0) -> int:
    """A bound on forward-pass scratch memory, kept out of the KV budget on GPU; the piecewise
    CUDA graphs' memory pool holds a piece's scratch for `graph_tokens` more (graphs.py)."""
    mc, c = settings.model_config, settings
    elem = torch.empty((), dtype=c.torch_dtype).element_size()
    t = c.max_num_batched_tokens
    ff = max(mc.intermediate_size, mc.moe.top_k * mc.moe.intermediate_size if mc.moe else 0)
    per_token = (2 * ff * 2 + mc.hidden_size * 6 + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim * 2)
    logits = c.max_num_seqs * mc.vocab_size * 4 * 3
    return int(1.2 * ((t + graph_tokens) * per_token * elem + logits)) + (256 << 20)


# what this process holds on its GPU that torch's allocator does not see: the CUDA context,
# NCCL's buffers, mapped modules
NON_TORCH_BYTES = 1 << 30


def share_budget(utilization: float, free: int, total: int, held: int, activation_bytes: int) -> int:
    """The KV bytes of a process's share of its GPU: `utilization` x the GPU's `total` memory,
    less what the process holds (`held`: torch's reserved memory; and NON_TORCH_BYTES) and its
    forward-pass scratch. Other processes on the GPU (another worker sharing it) do not count
    against it; a share that is not `free` is refused by name."""
    share = int(total * utilization)
    budget = share - held - NON_TORCH_BYTES - activation_bytes
    if budget + activation_bytes > free:
        gib = 1 << 30
        raise ValueError(f"gpu_memory_utilization {utilization:g} gives this worker {share / gib:.1f} GiB of the "
                         f"GPU's {total / gib:.1f} GiB; it holds {held / gib:.1f} GiB and needs "
                         f"{(budget + activation_bytes) / gib:.1f} GiB more, but {free / gib:.1f} GiB are free "
                         f"(other processes hold {max(0, total - free - held - NON_TORCH_BYTES) / gib:.1f} GiB): "
                         "lower gpu_memory_utilization so the shares of the processes on this GPU add up to at most 1")
    return budget


def gpu_kv_budget(utilization: float, dev: torch.device, activation_bytes: int) -> int:
    """share_budget of this process on its GPU, as the driver and torch's allocator count it."""
    # memory this process freed but its caching allocator still holds (an engine closed before
    # this one) is given back first, so that it is not counted as this process's
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return share_budget(utilization, free, total, torch.cuda.memory_reserved(dev), activation_bytes)


def num_kv_blocks(cache: CacheSettings, layout: KVLayout, device: torch.device, activation_bytes: int = 0) -> int:
    """How many blocks of `layout` the cache settings' budget buys on `device`: the override, a byte
    budget, or the worker's share of GPU memory less `activation_bytes` of scratch."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = gpu_kv_budget(cache.gpu_memory_utilization, device, activation_bytes)
    else:
        budget = 1 << 30  # CPU default: 1 GiB
    n = budget // layout.block_bytes
    if n < 1:
        raise ValueError(f"KV-cache budget of {budget} bytes is smaller than one block "
                         f"({layout.block_bytes} bytes); raise gpu_memory_utilization or "
                         "kv_cache_memory_bytes")
    return int(n)


def check_decode_room(cache: CacheSettings, max_num_seqs: int, num_blocks: int) -> None:
    """Refuses, in one line with the numbers, an engine whose KV room holds fewer than max_num_seqs
    sequences of cache.decode_batch_len tokens (a decode batch that would wait for blocks)."""
    n = cache.decode_batch_len
    if n is None:
        return
    bs = cache.block_size
    held = num_blocks // -(-n // bs)
    if held >= max_num_seqs:
        return
    room = f"decode_batch_len {n}: this worker's KV room, {num_blocks} blocks of {bs} = {num_blocks * bs} tokens, "
    more = ("give the worker more room (gpu_memory_utilization, more GPUs by tensor_parallel_size, a smaller "
            "kv_cache_dtype)")
    if held == 0:
        raise ValueError(f"{room}holds no sequence of {n} tokens: {more}, or lower decode_batch_len")
    raise ValueError(f"{room}holds {held} sequences of {n} tokens, fewer than its decode batch (max_num_seqs "
                     f"{max_num_seqs}): lower max_num_seqs to {held}, or {more}")


def allocate_kv_cache(layout: KVLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """`num_blocks` blocks of `layout` on `device`, zeroed (on CPU committed as they are first
    written: zeros_on_demand). The tensor's shape and dtype are the layout's (KVLayout.tensor), so
    what the wire check and the persisted tier describe is what is allocated."""
    shape, dtype = layout.tensor(num_blocks)
    if device.type == "cpu":
        return zeros_on_demand(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def zeros_on_demand(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on a memory file of its own (memfd), whose pages the kernel commits
    on first write: a large CPU cache costs resident memory as it fills, whatever the process
    allocated and freed before (docs/design/kv_cache.md). Another process of the host maps the
    same pages through /proc/<pid>/fd/<fd> (`shared_file`: the same-node handoff,
    transfer/shared.py); the file closes when the last view of the tensor is gone."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    buf = mmap.mmap(fd, nbytes)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    _SHARED_FILES[t.data_ptr()] = (os.getpid(), fd, nbytes)
    weakref.finalize(buf, _release, t.data_ptr(), fd)
    return t


_SHARED_FILES: dict[int, tuple[int, int, int]] = {}


def _release(address: int, fd: int) -> None:
    _SHARED_FILES.pop(address, None)
    os.close(fd)


def shared_file(kv: torch.Tensor) -> tuple[int, int, int] | None:
    """(pid, fd, bytes) of the memory file a zeros_on_demand tensor lives on, else None."""
    return _SHARED_FILES.get(kv.data_ptr())


def layer_views(kv: torch.Tensor, kv_cache_dtype: str = "auto") -> list[tuple]:
    """Per-layer (k_cache, v_cache) views, each [num_blocks, block_size, kv_heads, head_dim]
    (a quantized cache's: kv_quant.QuantKV or Int4KV pairs of values and scales); a latent
    cache's (one part) are (latent_cache, None)."""
    def view(t):
        return kv_quant.views(t, kv_cache_dtype) if kv_quant.is_scaled(kv_cache_dtype) else t

    return [(view(kv[:, layer, 0]), view(kv[:, layer, 1]) if kv.shape[2] == 2 else None)
            for layer in range(kv.shape[1])]
