"""The host tier on disk (`kv_persist_dir`): hot KV survives a restart, in the disk tier's format.

    <kv_persist_dir>/host_tier.json                        the tier's index: what its blocks
                                                           mean (BlockMeaning) and their hashes,
                                                           least recently used first
    <kv_persist_dir>/<layout digest>/<hash[:2]>/<hash>.kvb one block (tiers/disk.py's block files:
                                                           a header with its hash, byte count and
                                                           checksum, then its bytes)

    save        on close and every kv_persist_interval_s (a timer on the engine's thread, idle
                or not; skipped while the tier is as last saved): the blocks not on disk yet are
                written as block files (a block's file is named by its hash, so a save writes
                only the blocks offloaded since the previous one), then the index, to a
                temporary name and renamed. The store keeps as many files as the tier has slots
                and evicts first those the new index no longer names: a crash mid-save leaves the
                previous index, whose blocks this save evicted are then refused as missing, never
                read wrong. The caller first applies the
                copies still queued (blocks freed after the last step: their slots are assigned,
                their contents not yet copied).
    load        on start: the whole tier is refused (PersistError naming the mismatch; the engine
                starts with an empty tier) if the index is corrupt or malformed, if any of what
                the blocks mean differs (the model's fingerprint, KV dtype, block size, block
                layout), or if only an earlier version's snapshot (kv_host_tier.pt, one torch
                file) is there; each block whose file is missing or fails its checks, or whose
                values are not finite, is refused alone. `Restored` says what came back and what
                was refused, and why (why checksums: docs/design/persist.md).

The fingerprint is a hash of the model's config.json and, per safetensors file, its name,
size and its first and last MiB (a fine-tune of the same shapes differs there; hashing
whole checkpoints would take minutes); random weights (`load_format="dummy"`) fingerprint
their seed. Tensor-parallel engines do not persist yet (each rank holds a slice).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from ..base.kv_layout import KVLayout
from ..settings import TierSettings
from ..stats import WriteStats
from .disk import HEADER, BlockMeaning, DiskStore
from .offload import HostCache, HostIndex

log = logging.getLogger(__name__)

INDEX = "host_tier.json"
OLD_SNAPSHOT = "kv_host_tier.pt"  # an earlier version's format: one torch file, refused


class PersistError(ValueError):
    """A persisted host tier that cannot be used here (the message names why)."""


def fingerprint(model: str, load_format: str, seed: int) -> str:
    """The model directory's identity: its config.json and its weights (or, random weights of
    `load_format` "dummy", the seed they are drawn from)."""
    h = hashlib.sha256()
    with open(os.path.join(model, "config.json"), "rb") as f:
        h.update(f.read())
    if load_format == "dummy":
        h.update(f"dummy seed {seed}".encode())
        return h.hexdigest()
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def block_meaning(model: str, load_format: str, seed: int, layout: KVLayout) -> BlockMeaning:
    """What an engine's KV blocks mean on disk: its model's fingerprint and its cache layout (its
    runner's, one rank's)."""
    return BlockMeaning(fingerprint(model, load_format, seed), layout)


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
            why = [f"{n} {what}" for n, what in ((self.bad_checksum, "missing or failed their checksum"),
                                                 (self.not_finite, "hold NaN or Inf")) if n]
            text += f"; refused {self.refused} ({', '.join(why)})"
        return text


def store(tiers: TierSettings, meaning: BlockMeaning, cache: HostCache) -> DiskStore:
    """The persisted tier's block files: as many as the tier has slots (the blocks its index no
    longer names are evicted first)."""
    files = max(1, cache.buf.shape[0])
    return DiskStore(tiers.kv_persist_dir, meaning, cache.block_nbytes,
                     files * (HEADER.size + cache.block_nbytes), tier="kv_persist")


def save(tiers: TierSettings, meaning: BlockMeaning, index: HostIndex, cache: HostCache,
         files: DiskStore) -> str | None:
    """Writes the tier: its blocks not on disk yet, then its index; None (the previous index
    stays) when the block files could not be written. The copies queued in `index` must have
    been applied (HostTierFile.write does it). Raises the OSError of a failed index write."""
    if index.ops.offloads:
        raise RuntimeError("persist.save: offloads are still queued; apply them first (their slots hold no data yet)")
    cache.synchronize()  # the offloads issued so far have landed
    entries = index.entries()
    kept = files.keep([h for h, _ in entries])
    for h, slot in entries:
        if h not in kept:
            files.put(h, cache.slot_bytes(slot).copy())
    files.flush()
    if not files.health.writable:  # an index over blocks that are not there would only be refused
        return None
    path = os.path.join(tiers.kv_persist_dir, INDEX)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({**meaning.as_dict(), "hashes": [h.hex() for h, _ in entries]}, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return path


def load(tiers: TierSettings, meaning: BlockMeaning, index: HostIndex, cache: HostCache, files: DiskStore) -> Restored:
    """Fills the tier from its files (nothing without an index). Raises PersistError naming the
    problem (the tier is then left empty); blocks that do not verify are left out."""
    path = os.path.join(tiers.kv_persist_dir, INDEX)
    if not os.path.exists(path):
        old = os.path.join(tiers.kv_persist_dir, OLD_SNAPSHOT)
        if os.path.exists(old):
            raise PersistError(f"{old} is a host tier saved by an earlier version (one torch file); the tier is "
                               "now kept as block files: starting with an empty host tier (remove the file)")
        return Restored()
    try:
        with open(path) as f:
            payload = json.load(f)
        hashes = [bytes.fromhex(h) for h in payload["hashes"]]
    except Exception as e:  # noqa: BLE001 - whatever the JSON or the hex says
        raise PersistError(f"{path} is corrupt ({type(e).__name__}: {e}): starting with an empty host tier") from None
    differs = meaning.differs(payload)
    if differs is not None:
        key, there, here = differs
        raise PersistError(f"{path} was written for another {key.replace('_', ' ')} "
                           f"({_short(there)} there, {_short(here)} here): starting with an empty host tier")
    if not all(len(h) == 32 for h in hashes) or len(set(hashes)) != len(hashes):
        raise PersistError(f"{path} is corrupt (block hashes must be distinct 32-byte digests): "
                           "starting with an empty host tier")
    done, restored, slot = Restored(), [], 0
    for h in hashes[max(0, len(hashes) - index.num_slots):]:  # the most recently used, if the tier shrank
        if not files.read_into(h, cache.slot_bytes(slot)):
            done.bad_checksum += 1
        elif cache.buf.is_floating_point() and not bool(torch.isfinite(cache.buf[slot]).all()):
            done.not_finite += 1
        else:
            restored.append((h, slot))
            slot += 1
    index.restore(restored)
    done.blocks = len(restored)
    return done


def _short(v) -> str:
    s = str(v)
    return s if len(s) <= 24 else s[:16] + "..."


class HostTierFile:
    """An engine's host tier on disk: restored at start (`status` says what came back), written
    by `due()` when kv_persist_interval_s has passed and the tier changed since (after every step
    and, idle, by the loop that owns the engine: a crash loses at most one interval) and by
    `write()`, and a last time by `close()`. A directory that cannot be read or written never
    stops the engine: it starts with an empty tier, and a failed write marks the directory
    unwritable (`files.health`, write_health.py: logged once per cause, in `stats()`, retried)."""

    def __init__(self, tiers: TierSettings, meaning: BlockMeaning, index: HostIndex, cache: HostCache):
        """`tiers`: the directory and interval; `meaning`: the blocks' model and layout (block_meaning)."""
        self.tiers, self.meaning, self.index, self.cache = tiers, meaning, index, cache
        self.at = time.monotonic()
        self.files = store(tiers, meaning, cache)
        self.entries: list | None = None  # the tier's index as last written
        self.status: str | None = None
        try:
            done = load(tiers, meaning, index, cache, self.files)
            self.status = done.describe(tiers.kv_persist_dir)
            if done.refused:
                log.warning("%s", self.status)
        except PersistError as e:
            self.status = str(e)
            log.warning("%s", e)
        except OSError as e:  # the directory cannot be read (EIO, EACCES): serve without what it held
            self.status = f"{tiers.kv_persist_dir} could not be read ({e}): starting with an empty host tier"
            log.warning("%s", self.status)

    def due(self) -> bool:
        """Writes the tier if its interval has passed and it changed; True if it wrote."""
        if time.monotonic() - self.at < self.tiers.kv_persist_interval_s:
            return False
        self.at = time.monotonic()
        if not self.index.ops.offloads and self.index.entries() == self.entries:
            return False
        if not self.files.health.may_write():  # unwritable: tried again after its retry time
            return False
        return self.write() is not None

    def write(self) -> str | None:
        """Writes the tier now, after applying the copies still queued: blocks freed since the
        last forward have host slots but no contents there yet (docs/design/persist.md). Returns
        the index's path, or None if the directory could not be written (files.health says why)."""
        self.at = time.monotonic()
        self.cache.apply_queued(self.index)
        try:
            path = save(self.tiers, self.meaning, self.index, self.cache, self.files)
        except OSError as e:
            self.files.health.failed(e, "saving the tier's index")
            return None
        if path is not None:
            self.files.health.succeeded()
            self.entries = self.index.entries()
        return path

    def stats(self) -> WriteStats:
        return self.files.health.stats()

    def close(self) -> None:
        """Writes the tier a last time (the engine's close), then stops the block files' writer."""
        try:
            self.write()
        finally:
            self.files.close()
