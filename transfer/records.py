"""What a worker announces of its transfers: what two peers must share to exchange KV blocks
(`WireLayout`) and its pairs' links (`PairLink`); and the errors of a handoff and of a peer
refused for its layout. Nothing here loads torch: a worker's registration and stats carry these
(cluster/records.py), and the block registry that receives them runs without torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.base.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch


class TransferError(RuntimeError):
    pass


class LayoutMismatch(TransferError, ValueError):
    pass


_MAY_DIFFER = ("tp", "num_kv_heads")  # ranks of different TP sizes exchange head slices


@dataclass(frozen=True)
class WireLayout:
    """What two peers must share to exchange blocks: one rank's KV cache description (`kv`: the
    engine's KVLayout, with its values' dtype and scale bytes, so int8 and fp8 slabs of the same
    bytes differ), the chunking of a message, and the tensor-parallel split (`tp`, the model's
    `kv_heads_total`): a worker announces it (WorkerInfo.layout), a pair exchanges it as JSON in
    its store, and `check` refuses a peer whose KV differs. Its JSON is the wire format of before
    (the KV fields flat beside the three others)."""

    kv: KVLayout
    min_chunk_bytes: int = 0
    tp: int = 1
    kv_heads_total: int = 0

    @classmethod
    def of(cls, kv: torch.Tensor, chunk_bytes: int, tp: int = 1, kv_heads_total: int | None = None,
           kv_cache_dtype: str = "auto") -> WireLayout:
        lay = KVLayout.of(kv, kv_cache_dtype)
        return cls(lay, chunk_bytes, tp, kv_heads_total if kv_heads_total is not None else lay.num_kv_heads)

    @property
    def block_bytes(self) -> int:
        """A whole block's bytes: every rank's heads."""
        return dataclasses.replace(self.kv, num_kv_heads=self.kv_heads_total).block_bytes

    def fields(self) -> dict:
        return {**self.kv.as_dict(), "min_chunk_bytes": self.min_chunk_bytes, "tp": self.tp,
                "kv_heads_total": self.kv_heads_total}

    def to_json(self) -> str:
        return json.dumps(self.fields())

    @classmethod
    def from_json(cls, text: str | bytes) -> WireLayout:
        d = json.loads(text)
        rest = {k: d.pop(k) for k in ("min_chunk_bytes", "tp", "kv_heads_total")}
        return cls(KVLayout(**d), **rest)

    def check(self, theirs: WireLayout | None, peer: str) -> None:
        """Refuses a peer whose KV differs (or that announced none), naming the fields (ours, theirs)."""
        if theirs is None:
            raise LayoutMismatch(f"peer {peer!r} announced no KV layout (it serves no KV handoff)")
        mine, other = self.fields(), theirs.fields()
        keys = (set(mine) | set(other)) - set(_MAY_DIFFER)
        diff = {k: (mine.get(k), other.get(k)) for k in keys if mine.get(k) != other.get(k)}
        if "dtype" in diff or "scale_bytes" in diff:
            raise LayoutMismatch(f"KV cache dtypes differ: ours {mine.get('dtype')!r}, peer {peer!r}'s "
                                 f"{other.get('dtype')!r} (scale bytes {mine.get('scale_bytes')} vs "
                                 f"{other.get('scale_bytes')}): give the prefill and decode pools the same "
                                 "--kv-cache-dtype")
        if diff:
            raise LayoutMismatch(f"KV layout mismatch with peer {peer!r} (ours TP={mine.get('tp', 1)}, theirs "
                                 f"TP={other.get('tp', 1)}; ours, theirs): {diff}")


@dataclass(frozen=True)
class PairLink:
    """One connected pair's link as a worker's stats report it: the peer and this side's part
    (`side`: send | recv), the link (cuda-ipc | shared-memory | nccl | gloo) and why it was chosen,
    the pair's generation, both ends' host:port, and on a pull's receiving side how it checks that
    its sender lived through each copy (`liveness`: process | store; else None)."""
    peer: str
    side: str
    link: str
    why: str
    gen: int
    local: str | None
    peer_address: str | None
    liveness: str | None = None

    @property
    def key(self) -> str:
        return f"{self.peer} {self.side}"

    def as_dict(self) -> dict:
        """The status row's entry: {"link", "why", "gen", "local", "peer"[, "liveness"]}."""
        return {"link": self.link, "why": self.why, "gen": self.gen, "local": self.local, "peer": self.peer_address,
                **({"liveness": self.liveness} if self.liveness else {})}
