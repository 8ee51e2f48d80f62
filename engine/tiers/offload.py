"""The host-memory tier of the prefix cache (`kv_offloading_size` GiB per worker).

A block's KV across the tiers:

    GPU block cached (full, hashed)
      -> freed (no request holds it)  offloaded: copied to a host slot (D2H on a side
                                      stream, issued before the next forward and running
                                      beside it), unless its hash is already there
      -> reallocated on the GPU       its hash lives on in the host tier
    a prompt's lookup                 GPU hits, then host hits that continue the hash
                                      chain: each gets a fresh GPU block, is loaded back
                                      (H2D on the side stream; the step's forward waits
                                      for it) and becomes an ordinary GPU hit
    the host tier full                its least recently used slot is reused

Offloading at free time, not at eviction, keeps the copy off the step's critical path:
nothing overwrites a free block until it is reallocated, usually many steps later (the
GPU's free queue is LRU). The rare block reallocated while its copy may still run makes
that step's forward wait for the copy (`TierOps.wait`).

Rank 0 keeps the index (`HostIndex`: hash -> slot, LRU, the queued copies); every rank
applies the copies to its own KV and host buffer (`HostCache`, in the model runner), so
tensor-parallel shards follow rank 0 (the copies ride in the step's inputs).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..base.hashing import BlockHash, held_run
from ..stats import HostTierStats


@dataclass
class TierOps:
    """One step's copies: (GPU block, host slot) offloads, then (host slot, GPU block) loads."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    wait: bool = False  # a reallocated block's offload may still be running


class HostIndex:
    """The host tier's index (a KVTier, tier.py): which block hash each pinned host slot holds,
    least recently used first, and the copies the next step makes."""

    name = "host"
    waits = False

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block slot, got {num_slots}")
        self.num_slots = num_slots
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU: the front is reused first
        self.free = list(range(num_slots - 1, -1, -1))
        self.ops = TierOps()
        self.in_flight: set[int] = set()  # GPU blocks whose offload went out last step
        self.events: list[tuple[str, BlockHash]] = []  # host_stored / host_removed, for the registry
        self.record_events = False
        self.offloaded_blocks = 0
        self.loaded_blocks = 0
        self.on_evict = None  # (hash, slot) of a block the tier drops, before its slot is reused (disk tier)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    # ---- the tier protocol (tier.py) --------------------------------------------------------
    def lookup(self, hashes: list[BlockHash], request=None) -> int:
        return held_run(hashes, self.slots.__contains__)

    def load(self, request, hashes: list[BlockHash]) -> bool:
        """Nothing to wait for: the request's GPU lookup (KVCacheManager) queues the copies of
        these blocks into fresh GPU blocks when it is scheduled."""
        return False

    def ready(self) -> list:
        return []

    def wait(self, timeout: float = 0.05) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass  # its files, when it keeps them, are persist.HostTierFile's; below a disk tier, the disk's

    def evict(self, block_hash: BlockHash) -> bool:
        """Drops the block's copy (and a queued offload into its slot); its slot is free again."""
        slot = self.slots.pop(block_hash, None)
        if slot is None:
            return False
        self.ops.offloads = [(b, s) for b, s in self.ops.offloads if s != slot]
        self.free.append(slot)
        if self.record_events:
            self.events.append(("host_removed", block_hash))
        return True

    def stats(self) -> HostTierStats:
        return HostTierStats(blocks_total=self.num_slots, blocks_used=len(self.slots),
                             offloaded_blocks=self.offloaded_blocks, loaded_blocks=self.loaded_blocks)

    # ---- slots --------------------------------------------------------------------------------
    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The block's slot (now the most recently used), None if the tier does not hold it."""
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
        return slot

    def store(self, block_hash: BlockHash, block_id: int) -> None:
        """A cached GPU block was freed: keep a copy unless the tier has its hash."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return
        slot = self.free.pop() if self.free else self._reuse()
        self.slots[block_hash] = slot
        self.ops.offloads.append((block_id, slot))
        self.offloaded_blocks += 1
        if self.record_events:
            self.events.append(("host_stored", block_hash))

    def _reuse(self) -> int:
        old, slot = self.slots.popitem(last=False)
        if self.record_events:
            self.events.append(("host_removed", old))
        if self.on_evict is not None and not any(s == slot for _, s in self.ops.offloads):
            self.on_evict(old, slot)  # its bytes are in the slot (an offload still queued: not yet)
        return slot

    def admit(self, block_hash: BlockHash) -> int | None:
        """A slot for a block that arrives from below (the disk tier), its bytes to be written
        there by the caller now; None if the tier has the hash. A reused slot's queued offload
        (it would land over them) is dropped, its block no longer kept."""
        if block_hash in self.slots:
            return None
        slot = self.free.pop() if self.free else self._reuse()
        self.ops.offloads = [(b, s) for b, s in self.ops.offloads if s != slot]
        self.slots[block_hash] = slot
        if self.record_events:
            self.events.append(("host_stored", block_hash))
        return slot

    def queue_load(self, slot: int, block_id: int) -> None:
        """The copy of a slot into a GPU block, made before the next step's forward."""
        self.ops.loads.append((slot, block_id))
        self.loaded_blocks += 1

    def reallocated(self, block_id: int) -> None:
        """A GPU block is about to be overwritten: wait for its offload if it may still run."""
        if block_id in self.in_flight or any(b == block_id for b, _ in self.ops.offloads):
            self.ops.wait = True

    def take(self) -> TierOps | None:
        """The copies to apply before this step's forward (None: nothing to do)."""
        ops, self.ops = self.ops, TierOps()
        self.in_flight = {b for b, _ in ops.offloads}
        return ops if ops.offloads or ops.loads or ops.wait else None

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        events, self.events = self.events, []
        return events

    def entries(self) -> list[tuple[BlockHash, int]]:
        """(hash, slot), least recently used first."""
        return list(self.slots.items())

    def restore(self, entries: list[tuple[BlockHash, int]]) -> None:
        """Takes over slots whose contents are already in the host buffer (persistence)."""
        used = set()
        for h, slot in entries:
            if 0 <= slot < self.num_slots and slot not in used and h not in self.slots:
                self.slots[h] = slot
                used.add(slot)
                if self.record_events:
                    self.events.append(("host_stored", h))
        self.free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]


class HostCache:
    """A rank's host buffer (pinned on CUDA) for the blocks of its KV cache `kv`, and the side
    stream its copies run on."""

    def __init__(self, kv: torch.Tensor, num_slots: int):
        self.kv = kv
        self.cuda = kv.is_cuda
        self.buf = torch.empty((num_slots, *kv.shape[1:]), dtype=kv.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self.load_seconds = 0.0  # time of the load-backs that finished (GPU: measured by events)
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def apply(self, kv: torch.Tensor, ops: TierOps) -> None:
        if not self.cuda:
            t = time.perf_counter()
            for b, s in ops.offloads:
                self.buf[s].copy_(kv[b])
            for s, b in ops.loads:
                kv[b].copy_(self.buf[s])
            self.load_seconds += (time.perf_counter() - t) if ops.loads else 0.0
            return
        self._settle()
        compute = torch.cuda.current_stream(kv.device)
        self.stream.wait_stream(compute)  # the blocks were written by earlier steps
        with torch.cuda.stream(self.stream):
            for b, s in ops.offloads:
                self.buf[s].copy_(kv[b], non_blocking=True)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            for s, b in ops.loads:
                kv[b].copy_(self.buf[s], non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        if ops.loads:
            self._timing.append((start, end))
        if ops.loads or ops.wait:
            compute.wait_event(end)

    @property
    def block_nbytes(self) -> int:
        return self.buf[0].numel() * self.buf.element_size()

    def slot_bytes(self, slot: int) -> np.ndarray:
        """A slot's bytes as a uint8 view of the buffer (what the tiers on disk write and read into)."""
        return self.buf[slot].view(-1).view(torch.uint8).numpy()

    def apply_queued(self, index: HostIndex) -> None:
        """The copies `index` has queued, applied now (before a slot's bytes are read)."""
        ops = index.take()
        if ops is not None:
            self.apply(self.kv, ops)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.kv.device) if self.cuda else "cpu"

    def _settle(self) -> None:
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self.load_seconds += start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
            self._settle()


def host_slots(size_gib: float, block_bytes: int) -> int:
    return int(size_gib * (1 << 30)) // block_bytes
