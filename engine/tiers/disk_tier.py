"""The disk tier in the engine (`kv_disk_dir`, `kv_disk_size`): below the host tier, over the
block files of tiers/disk.py.

A block's way down and back up:

    host tier drops a block     (`store`, HostIndex.on_evict) its slot's bytes are copied out and
                                queued for the files' writer thread; the step does not wait on the disk
    a new request               (`lookup`, `load`: the engine's Tiers.hold, tier.py) its prompt's
                                blocks past the GPU and host hits that are on disk, in a run: read
                                back if the predicted read time (their
                                bytes over the bandwidth measured so far, reads and installs) is
                                below the predicted time to recompute them (the step-cost model;
                                before it knows any prefill: the rate saved with the tier, else
                                recompute); then the
                                request waits outside the scheduler while a reader thread reads
                                them (prefetch: the steps of other requests go on)
    its reads landed            (`ready`, before each schedule) each block takes a host slot as an
                                offload would, and the request goes to the scheduler, whose lookup
                                finds those blocks as host hits and loads them to the GPU
    close                       the host tier's blocks go to disk too: a restart finds them, and
                                the prefill rate this device measured (prefill_rate.json beside
                                them), so the first request after a restart already weighs its
                                reads against recomputing instead of recomputing blind

A block that fails its checks on read ends the run there (the rest is recomputed); one that a
full host tier drops again before its request is scheduled is recomputed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..base.hashing import held_run
from ..settings import TierSettings
from ..stats import DiskTierStats
from .disk import BlockMeaning, DiskStore
from .offload import HostCache, HostIndex

log = logging.getLogger(__name__)

RATE_FILE = "prefill_rate.json"  # beside the blocks: the prefill rate each device measured, for a restart
READ_GBPS_START = 2.0  # the read bandwidth assumed when the directory has no block to time yet
PROBE_BLOCKS = 8  # blocks read at start to time the disk (a restart's directory has some)
READERS = 4


class DiskTier:
    """The disk tier (a KVTier, tier.py) below the host tier."""

    name = "disk"
    waits = True

    @classmethod
    def of(cls, tiers: TierSettings, meaning: BlockMeaning, index: HostIndex | None, cache: HostCache | None,
           step_model, kv) -> DiskTier | None:
        """The engine's disk tier below its host tier (`index` its slots, `cache` its buffer), or None
        without kv_disk_dir; `meaning` its blocks' model and layout (persist.block_meaning); `kv` the
        engine's KV cache manager (the prompt's block hashes, GPU hits)."""
        if tiers.kv_disk_dir is None or index is None:
            return None
        return cls(tiers, meaning, index, cache, step_model, kv)

    def __init__(self, tiers: TierSettings, meaning: BlockMeaning, index: HostIndex, cache: HostCache, step_model,
                 kv):
        self.index, self.cache, self.step_model, self.kv = index, cache, step_model, kv
        self.block_size = meaning.layout.block_size
        self.block_nbytes = cache.block_nbytes
        self.files = DiskStore(tiers.kv_disk_dir, meaning, self.block_nbytes, int(tiers.kv_disk_size * (1 << 30)))
        index.on_evict = self.store
        # several readers: each read verifies a checksum (hashlib lets go of the GIL for it)
        self.reader = ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-reader")
        self.holding: dict[str, tuple] = {}  # request id -> (request, its reads, when they started)
        self.read_gbps = self._probe()
        self.device = cache.device_name()
        if not step_model.prefill_tok_s:  # a restart knows what reading a block is worth from the start
            step_model.prefill_tok_s = self._rates().get(self.device, 0.0)
        self.hit_tokens = 0  # prompt tokens whose KV came back from disk
        self.skipped_tokens = 0  # on disk, but recomputing was predicted faster
        self.prefetch_seconds = 0.0  # summed over requests: from hold() to ready()
        self.prefetches = 0

    def _slot_bytes(self, slot: int) -> np.ndarray:
        return self.cache.slot_bytes(slot)

    def _settle(self) -> None:
        """The host buffer's copies in flight have landed (a slot about to be read or written)."""
        if self.cache.stream is not None:
            self.cache.stream.synchronize()

    # ---- down ---------------------------------------------------------------------------------
    def store(self, block_hash: bytes, slot: int) -> None:
        """The host tier drops the block in `slot` (HostIndex.on_evict): its bytes are copied out and
        queued for the writer thread."""
        self._settle()
        self.files.put(block_hash, self._slot_bytes(slot).copy())

    def evict(self, block_hash: bytes) -> bool:
        if block_hash not in self.files:
            return False
        self.files.remove(block_hash)
        return True

    # ---- up -----------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], request=None) -> int:
        return held_run(hashes, self.files.__contains__)

    def load(self, request, hashes: list[bytes]) -> bool:
        """Starts reading the run `hashes` of the request's prompt (after its GPU and host hits),
        if that pays; True if the request now waits for them (ready() returns it)."""
        tokens = len(hashes) * self.block_size
        read_s = len(hashes) * self.block_nbytes / (self.read_gbps * 1e9)
        before = self.kv.block_hashes(request).index(hashes[0])  # the blocks cached above the run
        if read_s >= self.recompute_seconds(tokens, before * self.block_size):
            self.skipped_tokens += tokens
            return False
        reads = [(h, self.reader.submit(self._read, h)) for h in hashes]
        self.holding[request.request_id] = (request, reads, time.monotonic())
        return True

    def forget(self, request_id: str) -> None:
        """An aborted request's reads land unclaimed."""
        self.holding.pop(request_id, None)

    def recompute_seconds(self, tokens: int, context: int) -> float:
        """What prefilling `tokens` after `context` cached ones is predicted to take: the step
        model's fit once it has prefill terms, before that the prefill rate it measured, before
        any prefill 0 (nothing known: recompute, never wait on a disk of unknown worth)."""
        sm = self.step_model
        if sm.prefill_fitted:  # its tokens x their mean context (StepShape.attn)
            return sm.predict(0, tokens, 0, tokens * (context + tokens / 2))
        return tokens / sm.prefill_tok_s if sm.prefill_tok_s else 0.0

    def _rates(self) -> dict[str, float]:
        """The prefill rates measured on this tier's model and layout, by device name."""
        try:
            with open(os.path.join(self.files.dir, RATE_FILE)) as f:
                rates = json.load(f)
            return {str(k): float(v) for k, v in rates.items() if float(v) > 0}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _save_rate(self) -> None:
        """This device's measured prefill rate, for the next start (written whole, renamed into
        place: workers sharing the directory race harmlessly)."""
        if not self.step_model.prefill_tok_s:
            return
        rates = {**self._rates(), self.device: self.step_model.prefill_tok_s}
        path = os.path.join(self.files.dir, RATE_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(rates, f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not save the prefill rate beside the disk tier: %s", e)

    def _probe(self) -> float:
        """The read bandwidth of up to PROBE_BLOCKS of the directory's blocks (else the default);
        every read after updates it."""
        out = np.empty(self.block_nbytes, dtype=np.uint8)
        took = done = 0
        for h in list(self.files.index)[-PROBE_BLOCKS:]:
            t = time.perf_counter()
            if self.files.read_into(h, out):
                took, done = took + time.perf_counter() - t, done + 1
        return done * self.block_nbytes / took / 1e9 if done and took > 0 else READ_GBPS_START

    def _read(self, block_hash: bytes) -> np.ndarray | None:
        out = np.empty(self.block_nbytes, dtype=np.uint8)
        return out if self.files.read_into(block_hash, out) else None

    def wait(self, timeout: float = 0.05) -> None:
        """Blocks until the first held request's reads finish (at most `timeout`): an engine with
        nothing else to run waits here rather than spinning against the reader threads."""
        if self.holding:
            _, reads, _ = next(iter(self.holding.values()))
            futures.wait([f for _, f in reads], timeout=timeout)

    def ready(self) -> list:
        """The held requests whose reads have all finished, their blocks now in the host tier."""
        out = []
        for rid, (request, reads, t0) in list(self.holding.items()):
            if not all(f.done() for _, f in reads):
                continue
            del self.holding[rid]
            landed = self._install(reads)
            took = time.monotonic() - t0
            self.prefetch_seconds += took
            self.prefetches += 1
            if landed and took > 0:  # hold() to ready(), reads and installs: recent requests weigh most
                self.read_gbps = 0.5 * self.read_gbps + 0.5 * landed * self.block_nbytes / took / 1e9
            out.append(request)
        return out

    def _install(self, reads: list[tuple[bytes, Future]]) -> int:
        landed = 0
        for h, f in reads:
            data = f.result()
            if data is None:  # not there any more, or refused: the rest of the run is recomputed
                break
            slot = self.index.admit(h)
            if slot is not None:
                self._settle()
                self._slot_bytes(slot)[:] = data
            landed += 1
        self.hit_tokens += landed * self.block_size
        return landed

    # ---- the tier as a whole ------------------------------------------------------------------
    def close(self) -> None:
        """The host tier's blocks written to disk (their queued copies applied first), the writer
        drained, and the prefill rate measured here saved beside them."""
        self.cache.apply_queued(self.index)
        self._settle()
        for h, slot in self.index.entries():
            self.files.put(h, self._slot_bytes(slot).copy())
        self.reader.shutdown(wait=True)
        self.files.close()
        self._save_rate()

    def stats(self) -> DiskTierStats:
        s = self.files.stats
        return DiskTierStats(hit_tokens=self.hit_tokens, skipped_tokens=self.skipped_tokens,
                             blocks=len(self.files.index), blocks_total=self.files.capacity,
                             written_bytes=s.written_bytes, read_bytes=s.read_bytes, refused_blocks=s.refused_blocks,
                             read_gbps=self.read_gbps, prefetch_seconds=self.prefetch_seconds / max(1, self.prefetches),
                             waiting=len(self.holding), writes=self.files.health.stats())
