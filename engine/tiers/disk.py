"""The disk tier: KV blocks as files under `kv_disk_dir`, below the host tier.

    <kv_disk_dir>/<layout digest>/<hash[:2]>/<hash>.kvb    one block: a header, then its bytes

The layout digest (the model's fingerprint, KV dtype, block size and block layout: what a
block's bytes mean) names a directory of its own, so blocks of another model or layout are never
found. A file's header holds its block hash, its byte count and a checksum (blake2b over the hash
and the bytes); a file whose size, hash or checksum does not match is refused when read (that
block alone: it counts as a miss and the file is removed).

Writes go through a side thread (`put` queues, the thread writes in batches): each file is
written under a temporary name of its writer's and renamed into place, so a reader sees a
whole block or none, two workers writing the same block race harmlessly (the same bytes, one
rename wins), and a worker killed mid-write leaves only its temporary file, which is never read
and is removed by the next scan once no live process owns it. Reads (`read_into`) run on the
caller's thread.

Eviction is LRU within `capacity_bytes`, by the files this store knows: those it found when it
scanned the directory (at start and every `rescan_s`, so a shared directory's other writers'
files count too), those it wrote and those it read. A hit refreshes the file's mtime, which is
the LRU order a scan rebuilds. A restart finds what is on disk.

A directory that stops taking writes never stops serving (write_health.py): a write that fails
leaves no temporary file, marks the store unwritable (logged once per cause, in its stats) and
the writes after it are skipped until a retry succeeds; reads go on. A full file system
(ENOSPC) first makes room: the store's capacity shrinks to what it holds less a sixteenth, the
oldest blocks are evicted, and the write is tried once more. A store whose directory cannot even
be made starts empty and unwritable.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..base.kv_layout import KVLayout
from .write_health import WriteHealth

log = logging.getLogger(__name__)

MAGIC = b"PDKVBLK1"
DIGEST_BYTES = 16  # a block's checksum
HEADER = struct.Struct("<8s32sQ16s")  # magic, block hash, byte count, checksum
SUFFIX = ".kvb"


FORMAT = 2  # what a block file holds (2: a per-block checksum); a part of what its blocks mean


@dataclass(frozen=True)
class BlockMeaning:
    """What a KV block's bytes mean, for both tiers on disk: the model they were computed by (its
    fingerprint, tiers/persist.py) and the cache layout they are in. The disk tier's directory is
    named by its digest; the persisted host tier's index carries its fields, and an index whose
    fields differ is refused (`differs`)."""

    fingerprint: str
    layout: KVLayout
    format: int = FORMAT

    FIELDS = ("format", "fingerprint", "kv_cache_dtype", "block_size", "layout")

    def as_dict(self) -> dict:
        """The fields as JSON writes them (the persisted index's header)."""
        return {"format": self.format, "fingerprint": self.fingerprint, "kv_cache_dtype": self.layout.dtype,
                "block_size": self.layout.block_size, "layout": self.layout.as_dict()}

    def digest(self) -> str:
        """The directory name for blocks of this meaning."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True, default=str).encode()).hexdigest()[:24]

    def differs(self, payload: dict) -> tuple[str, object, object] | None:
        """The first field a written header holds otherwise: (field, there, here); None when all agree."""
        mine = self.as_dict()
        for key in self.FIELDS:
            if payload.get(key) != mine[key]:
                return key, payload.get(key), mine[key]
        return None


def checksum(block_hash: bytes, data) -> bytes:
    """A block's checksum, the one both the disk tier's files and the persisted host tier keep:
    blake2b over its hash and its bytes (a block moved under another hash fails too)."""
    h = hashlib.blake2b(block_hash, digest_size=DIGEST_BYTES)
    h.update(data)
    return h.digest()


@dataclass
class DiskStats:
    written_blocks: int = 0
    written_bytes: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    refused_blocks: int = 0  # failed their size, hash or checksum check when read
    evicted_blocks: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


class DiskStore:
    def __init__(self, root: str, meaning: BlockMeaning, block_nbytes: int, capacity_bytes: int, rescan_s: float = 60.0,
                 tier: str = "kv_disk"):
        """`tier`: its stats' prefix (WriteHealth)."""
        if capacity_bytes < block_nbytes:
            raise ValueError(f"kv_disk_size holds no block: {capacity_bytes} bytes, a block is {block_nbytes}")
        self.dir = os.path.join(root, meaning.digest())
        self.health = WriteHealth(tier, self.dir)
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            self.health.failed(e, "creating the directory")
        self.block_nbytes = block_nbytes
        self.file_bytes = HEADER.size + block_nbytes
        self.capacity = capacity_bytes // self.file_bytes  # files
        self.rescan_s = rescan_s
        self.stats = DiskStats()
        self.lock = threading.Lock()  # the index: the engine thread reads, the writer thread adds
        self.index: OrderedDict[bytes, None] = OrderedDict()  # LRU: the front is evicted first
        self.pending: dict[bytes, np.ndarray] = {}  # queued, not yet written: found and read from here
        self._tmp = 0
        self._token = os.urandom(4).hex()  # temporary names unique to this store, even within a process
        self.scan()
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self.thread.start()

    def path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    # ---- lookups and reads (the caller's thread) ----------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        """On disk, as far as this store knows or a stat finds (another worker's new file)."""
        with self.lock:
            if block_hash in self.index or block_hash in self.pending:
                return True
        if os.path.exists(self.path(block_hash)):
            with self.lock:
                self.index[block_hash] = None
            return True
        return False

    def read_into(self, block_hash: bytes, out: np.ndarray) -> bool:
        """The block's bytes into `out` (uint8, block_nbytes); False if it is not there or is
        refused (a wrong size, hash or checksum: the file is removed)."""
        t = time.perf_counter()
        with self.lock:
            queued = self.pending.get(block_hash)
        if queued is not None:  # still on its way to the disk
            out[:] = queued
            return True
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                n = f.readinto(memoryview(out)) if len(head) == HEADER.size else 0
                extra = f.read(1)
        except FileNotFoundError:  # evicted by another worker since the lookup
            self._forget(block_hash)
            return False
        ok = len(head) == HEADER.size and not extra and n == self.block_nbytes
        if ok:
            magic, h, nbytes, digest = HEADER.unpack(head)
            ok = magic == MAGIC and h == block_hash and nbytes == n and checksum(h, out) == digest
        if not ok:
            self.stats.refused_blocks += 1
            log.warning("disk tier: refused %s (a wrong size, hash or checksum)", path)
            self.remove(block_hash)
            return False
        try:
            os.utime(path)  # the LRU order a scan rebuilds
        except OSError:  # a read-only directory: the order is this store's own until it is writable
            pass
        with self.lock:
            self.index[block_hash] = None
            self.index.move_to_end(block_hash)
        self.stats.read_blocks += 1
        self.stats.read_bytes += n
        self.stats.read_seconds += time.perf_counter() - t
        return True

    def keep(self, hashes: list[bytes]) -> set[bytes]:
        """Those of `hashes` this store has (on disk or queued), moved to the recently used end in
        their order: eviction takes the others first. Returns them."""
        kept = set()
        for h in hashes:
            if h in self:
                with self.lock:
                    if h in self.index:
                        self.index.move_to_end(h)
                kept.add(h)
        return kept

    # ---- writes (the side thread) -------------------------------------------------------------
    def put(self, block_hash: bytes, data: np.ndarray, done=None) -> None:
        """Queues the block's bytes (uint8, block_nbytes; not changed until `done()` is called on
        the writer thread, after the write); lookups and reads find it meanwhile."""
        with self.lock:
            self.pending[block_hash] = data
        self.queue.put((block_hash, data, done))

    def flush(self) -> None:
        """Returns once everything queued so far is written."""
        self.queue.join()

    def close(self) -> None:
        self.flush()
        self.queue.put(None)
        self.thread.join(30)

    def _writer(self) -> None:
        last_scan = time.monotonic()
        while True:
            item = self.queue.get()
            batch = [item]
            while item is not None and not self.queue.empty() and len(batch) < 64:
                batch.append(item := self.queue.get_nowait())
            for it in batch:
                if it is None:
                    self.queue.task_done()
                    return
                try:
                    if self.health.may_write():
                        self._write(*it[:2])
                        self._evict()  # before task_done: flush() returns with the size kept
                except OSError as e:  # a full or failing disk: the block is only not kept
                    self.health.failed(e, "writing a block")
                finally:
                    with self.lock:
                        if self.pending.get(it[0]) is it[1]:
                            del self.pending[it[0]]
                    if it[2] is not None:
                        it[2]()
                    self.queue.task_done()
            if time.monotonic() - last_scan > self.rescan_s:
                self.scan()
                last_scan = time.monotonic()

    def _write(self, block_hash: bytes, data: np.ndarray) -> None:
        with self.lock:
            known = block_hash in self.index
            if known:
                self.index.move_to_end(block_hash)
        if known or os.path.exists(self.path(block_hash)):
            return
        t = time.perf_counter()
        path = self.path(block_hash)
        try:
            self._write_file(path, block_hash, data)
        except OSError as e:
            if e.errno != errno.ENOSPC or not self._make_room():
                raise
            self._write_file(path, block_hash, data)  # once more, with room made
        self.health.succeeded()
        with self.lock:
            self.index[block_hash] = None
        self.stats.written_blocks += 1
        self.stats.written_bytes += data.nbytes
        self.stats.write_seconds += time.perf_counter() - t

    def _write_file(self, path: str, block_hash: bytes, data: np.ndarray) -> None:
        """The block's file, whole or not at all: a failed write leaves no temporary file."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._tmp += 1
        tmp = f"{path}.tmp-{os.getpid()}-{self._token}-{self._tmp}"
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, block_hash, data.nbytes, checksum(block_hash, data)))
                f.write(memoryview(data))
            os.replace(tmp, path)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise

    def _make_room(self) -> bool:
        """The file system is full (ENOSPC): the capacity becomes what the store holds less a
        sixteenth and the oldest blocks go. False if it holds nothing to evict."""
        with self.lock:
            held = len(self.index)
        if held == 0:
            return False
        new = max(1, held - max(1, held // 16))
        if new < self.capacity:
            log.warning("disk tier (%s): the file system is full at %d blocks: its capacity is now %d blocks",
                        self.dir, held, new)
            self.capacity = new
        self._evict()
        return True

    def _evict(self) -> None:
        while True:
            with self.lock:
                if len(self.index) <= self.capacity:
                    return
                old, _ = self.index.popitem(last=False)
            try:
                os.remove(self.path(old))
            except FileNotFoundError:
                pass
            except OSError as e:  # read-only: the file stays, out of the index (a scan finds it again)
                self.health.failed(e, "evicting a block")
            self.stats.evicted_blocks += 1

    def _forget(self, block_hash: bytes) -> None:
        with self.lock:
            self.index.pop(block_hash, None)

    def remove(self, block_hash: bytes) -> None:
        """The block's file and its index entry gone."""
        self._forget(block_hash)
        try:
            os.remove(self.path(block_hash))
        except FileNotFoundError:
            pass
        except OSError as e:  # read-only: it stays on disk, out of the index (never read: refused)
            self.health.failed(e, "removing a block")

    # ---- the directory ------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuilds the index from the directory (LRU by mtime) and removes the temporary files
        of writers no longer running."""
        found = []
        try:
            subs = [sub.path for sub in os.scandir(self.dir) if sub.is_dir()]
        except OSError:  # not there (it could not be made): nothing on disk
            subs = []
        for sub in subs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for e in entries:
                if e.name.endswith(SUFFIX) and len(e.name) == 64 + len(SUFFIX):
                    try:
                        found.append((e.stat().st_mtime, bytes.fromhex(e.name[:64])))
                    except (OSError, ValueError):
                        continue
                elif ".tmp-" in e.name and not _alive(e.name.rsplit(".tmp-", 1)[1].split("-")[0]):
                    try:
                        os.remove(e.path)
                    except FileNotFoundError:
                        pass
                    except OSError as err:  # read-only: left for a scan once it is writable
                        self.health.failed(err, "removing a dead writer's temporary file")
        found.sort()  # every hit touches its file: mtime is the LRU order across writers
        with self.lock:
            self.index = OrderedDict((h, None) for _, h in found)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
