"""The host tier on disk (`kv_persist_dir`): hot KV survives a restart.

    save(dir)   on close and every kv_persist_interval_s: the host buffer and its index
                (hash -> slot, LRU order) with what the blocks depend on: the model's
                fingerprint, KV dtype, block size and block layout. Written to a temporary
                file, then renamed: a crash mid-write leaves the previous file.
    load(dir)   on start: refused (PersistError naming the mismatch; the engine starts
                with an empty tier) if the file is corrupt or any of those differ.

The fingerprint is a hash of the model's config.json and, per safetensors file, its name,
size and its first and last MiB (a fine-tune of the same shapes differs there; hashing
whole checkpoints would take minutes); random weights (`load_format="dummy"`) fingerprint
their seed. Tensor-parallel engines do not persist yet (each rank holds a slice).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os

import torch

from .config import EngineConfig
from .kv_cache import kv_layout
from .offload import HostCache, HostIndex

log = logging.getLogger(__name__)

FILE = "kv_host_tier.pt"
FORMAT = 1


class PersistError(ValueError):
    """A persisted host tier that cannot be used here (the message names why)."""


def fingerprint(config: EngineConfig, load_format: str) -> str:
    h = hashlib.sha256()
    with open(os.path.join(config.model, "config.json"), "rb") as f:
        h.update(f.read())
    if load_format == "dummy":
        h.update(f"dummy seed {config.seed}".encode())
        return h.hexdigest()
    for path in sorted(glob.glob(os.path.join(config.model, "*.safetensors"))):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def _meta(config: EngineConfig, load_format: str) -> dict:
    return {"format": FORMAT, "fingerprint": fingerprint(config, load_format),
            "kv_cache_dtype": str(config.kv_dtype).removeprefix("torch."), "block_size": config.block_size,
            "layout": kv_layout(config).as_dict()}


def save(config: EngineConfig, load_format: str, index: HostIndex, cache: HostCache) -> str:
    cache.synchronize()  # the offloads issued so far have landed
    os.makedirs(config.kv_persist_dir, exist_ok=True)
    path = os.path.join(config.kv_persist_dir, FILE)
    entries = index.entries()
    slots = torch.tensor([s for _, s in entries], dtype=torch.int64)
    payload = {**_meta(config, load_format), "hashes": [h for h, _ in entries],
               "blocks": cache.buf.index_select(0, slots) if len(entries) else cache.buf[:0]}
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load(config: EngineConfig, load_format: str, index: HostIndex, cache: HostCache) -> int:
    """Fills the tier from the file; returns the blocks restored (0 without a file).
    Raises PersistError naming the problem; the tier is then left empty."""
    path = os.path.join(config.kv_persist_dir, FILE)
    if not os.path.exists(path):
        return 0
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        hashes, blocks = payload["hashes"], payload["blocks"]
        if not isinstance(hashes, list) or blocks.shape[0] != len(hashes):
            raise ValueError(f"{len(hashes)} hashes for {blocks.shape[0]} blocks")
    except Exception as e:  # noqa: BLE001 - whatever torch.load or the shape check says
        raise PersistError(f"{path} is corrupt ({type(e).__name__}: {e}): starting with an empty host tier") from None
    want = _meta(config, load_format)
    for key in ("format", "fingerprint", "kv_cache_dtype", "block_size", "layout"):
        if payload.get(key) != want[key]:
            raise PersistError(f"{path} was written for another {key.replace('_', ' ')} "
                               f"({_short(payload.get(key))} there, {_short(want[key])} here): "
                               "starting with an empty host tier")
    if tuple(blocks.shape[1:]) != tuple(cache.buf.shape[1:]):
        raise PersistError(f"{path}: blocks of shape {tuple(blocks.shape[1:])}, this tier holds "
                           f"{tuple(cache.buf.shape[1:])}: starting with an empty host tier")
    keep = min(len(hashes), index.num_slots)  # the most recently used ones, if the tier shrank
    start = len(hashes) - keep
    cache.buf[:keep].copy_(blocks[start:])
    index.restore([(h, i) for i, h in enumerate(hashes[start:])])
    return keep


def _short(v) -> str:
    s = str(v)
    return s if len(s) <= 24 else s[:16] + "..."
