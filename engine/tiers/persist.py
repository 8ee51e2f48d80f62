"""The host tier on disk (`kv_persist_dir`): hot KV survives a restart.

    save(dir)   on close and every kv_persist_interval_s (a timer on the engine's thread, idle
                or not; skipped while the tier is as last saved): the used blocks and their index
                (hash -> slot, LRU order), one checksum per block (blake2b over the block's
                hash and bytes), with what the blocks depend on: the model's fingerprint,
                KV dtype, block size and block layout. The caller first applies the copies
                still queued (blocks freed after the last step: their slots are assigned, their
                contents not yet copied). Written to a temporary file, then renamed: a crash
                mid-write leaves the previous file.
    load(dir)   on start: the whole file is refused (PersistError naming the mismatch; the engine
                starts with an empty tier) if it is corrupt, malformed or any of those differ;
                each block whose checksum does not verify, or whose values are not finite, is
                refused alone. `Restored` says what came back and what was refused, and why.
Checksums of unchanged slots are kept between
saves (a slot is rewritten only when it is given to another hash), so the periodic save hashes
only the blocks offloaded since the previous one (why checksums: docs/design/persist.md).

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
import time
from dataclasses import dataclass

import torch

from ..base.kv_layout import kv_layout
from ..config import EngineConfig
from .disk import DIGEST_BYTES, checksum
from .offload import HostCache, HostIndex

log = logging.getLogger(__name__)

FILE = "kv_host_tier.pt"
FORMAT = 2  # 2: per-block checksums


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


def layout_meta(config: EngineConfig, load_format: str) -> dict:
    """What a KV block's bytes mean, for both tiers on disk: the persisted host tier's file carries
    it (a file whose fields differ is refused), the disk tier's directory is named by its digest
    (disk.layout_digest)."""
    return {"format": FORMAT, "fingerprint": fingerprint(config, load_format),
            "kv_cache_dtype": kv_layout(config).dtype, "block_size": config.block_size,
            "layout": kv_layout(config).as_dict()}


@dataclass
class Restored:
    """What load() brought back from disk, and what it refused and why."""

    blocks: int = 0
    bad_checksum: int = 0
    not_finite: int = 0

    @property
    def refused(self) -> int:
        return self.bad_checksum + self.not_finite

    def describe(self, where: str) -> str:
        text = f"restored {self.blocks} blocks from {where}"
        if self.refused:
            why = [f"{n} {what}" for n, what in ((self.bad_checksum, "failed their checksum"),
                                                 (self.not_finite, "hold NaN or Inf")) if n]
            text += f"; refused {self.refused} ({', '.join(why)})"
        return text


def block_digest(block_hash: bytes, block: torch.Tensor) -> bytes:
    """A block's checksum (disk.checksum, the disk tier's) over its tensor's bytes."""
    return checksum(block_hash, block.contiguous().view(torch.uint8).numpy())


class Checksums:
    """Digests of the host tier's blocks by hash, kept between saves: a slot's bytes change
    only when the slot goes to another hash, so each save hashes only the new blocks."""

    def __init__(self):
        self.by_hash: dict[bytes, tuple[int, bytes]] = {}  # hash -> (slot, digest)

    def of(self, entries: list[tuple[bytes, int]], buf: torch.Tensor) -> list[bytes]:
        fresh = {}
        for h, slot in entries:
            known = self.by_hash.get(h)
            fresh[h] = known if known is not None and known[0] == slot else (slot, block_digest(h, buf[slot]))
        self.by_hash = fresh
        return [fresh[h][1] for h, _ in entries]


def save(config: EngineConfig, load_format: str, index: HostIndex, cache: HostCache,
         checksums: Checksums | None = None) -> str:
    """Writes the tier; the copies queued in `index` must have been applied (HostTierFile.write
    does it)."""
    if index.ops.offloads:
        raise RuntimeError("persist.save: offloads are still queued; apply them first (their slots hold no data yet)")
    cache.synchronize()  # the offloads issued so far have landed
    os.makedirs(config.kv_persist_dir, exist_ok=True)
    path = os.path.join(config.kv_persist_dir, FILE)
    entries = index.entries()
    slots = torch.tensor([s for _, s in entries], dtype=torch.int64)
    payload = {**layout_meta(config, load_format), "hashes": [h for h, _ in entries],
               "checksums": (checksums or Checksums()).of(entries, cache.buf),
               # the used blocks only, in a tensor of their own: torch.save of a view writes its
               # whole storage (an empty tier was once saved as the whole host buffer)
               "blocks": cache.buf.index_select(0, slots)}
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load(config: EngineConfig, load_format: str, index: HostIndex, cache: HostCache) -> Restored:
    """Fills the tier from the file (nothing without one). Raises PersistError naming the
    problem (the tier is then left empty); blocks that do not verify are left out."""
    path = os.path.join(config.kv_persist_dir, FILE)
    if not os.path.exists(path):
        return Restored()
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        hashes, sums, blocks = payload["hashes"], payload.get("checksums"), payload["blocks"]
        if not isinstance(hashes, list) or not isinstance(blocks, torch.Tensor) or blocks.shape[0] != len(hashes):
            raise ValueError(f"{len(hashes)} hashes for {getattr(blocks, 'shape', ['?'])[0]} blocks")
    except Exception as e:  # noqa: BLE001 - whatever torch.load or the shape check says
        raise PersistError(f"{path} is corrupt ({type(e).__name__}: {e}): starting with an empty host tier") from None
    want = layout_meta(config, load_format)
    for key in ("format", "fingerprint", "kv_cache_dtype", "block_size", "layout"):
        if payload.get(key) != want[key]:
            raise PersistError(f"{path} was written for another {key.replace('_', ' ')} "
                               f"({_short(payload.get(key))} there, {_short(want[key])} here): "
                               "starting with an empty host tier")
    if not all(isinstance(h, bytes) and len(h) == 32 for h in hashes) or len(set(hashes)) != len(hashes):
        raise PersistError(f"{path} is corrupt (block hashes must be distinct 32-byte digests): "
                           "starting with an empty host tier")
    if not isinstance(sums, list) or len(sums) != len(hashes) or \
            not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in sums):
        raise PersistError(f"{path} is corrupt (one {DIGEST_BYTES}-byte checksum per block expected): "
                           "starting with an empty host tier")
    if blocks.dtype != cache.buf.dtype or tuple(blocks.shape[1:]) != tuple(cache.buf.shape[1:]):
        raise PersistError(f"{path}: blocks of {blocks.dtype} {tuple(blocks.shape[1:])}, this tier holds "
                           f"{cache.buf.dtype} {tuple(cache.buf.shape[1:])}: starting with an empty host tier")
    done = Restored()
    good = []
    for i, (h, digest) in enumerate(zip(hashes, sums)):
        if block_digest(h, blocks[i]) != digest:
            done.bad_checksum += 1
        elif blocks.is_floating_point() and not bool(torch.isfinite(blocks[i]).all()):
            done.not_finite += 1
        else:
            good.append(i)
    good = good[max(0, len(good) - index.num_slots):]  # the most recently used ones, if the tier shrank
    for slot, i in enumerate(good):
        cache.buf[slot].copy_(blocks[i])
    index.restore([(hashes[i], slot) for slot, i in enumerate(good)])
    done.blocks = len(good)
    return done


def _short(v) -> str:
    s = str(v)
    return s if len(s) <= 24 else s[:16] + "..."


class HostTierFile:
    """An engine's host tier on disk: restored at start (`status` says what came back), written
    by `due()` when kv_persist_interval_s has passed and the tier changed since (after every step
    and, idle, by the loop that owns the engine: a crash loses at most one interval) and by
    `write()` (also at close)."""

    def __init__(self, config: EngineConfig, load_format: str, index: HostIndex, runner):
        self.config, self.load_format, self.index, self.runner = config, load_format, index, runner
        self.at = time.monotonic()
        self.checksums = Checksums()
        self.entries: list | None = None  # the tier's index as last written
        self.status: str | None = None
        try:
            done = load(config, load_format, index, runner.host)
            self.status = done.describe(config.kv_persist_dir)
            if done.refused:
                log.warning("%s", self.status)
        except PersistError as e:
            self.status = str(e)
            log.warning("%s", e)

    def due(self) -> bool:
        """Writes the tier if its interval has passed and it changed; True if it wrote."""
        if time.monotonic() - self.at < self.config.kv_persist_interval_s:
            return False
        self.at = time.monotonic()
        if not self.index.ops.offloads and self.index.entries() == self.entries:
            return False
        self.write()
        return True

    def write(self) -> str:
        """Writes the tier now, after applying the copies still queued: blocks freed since the
        last forward have host slots but no contents there yet (docs/design/persist.md)."""
        self.at = time.monotonic()
        ops = self.index.take()
        if ops is not None:
            self.runner.host.apply(self.runner.kv, ops)
        path = save(self.config, self.load_format, self.index, self.runner.host, self.checksums)
        self.entries = self.index.entries()
        return path
