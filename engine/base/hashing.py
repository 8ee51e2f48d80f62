"""Chained block hashes, identical in every process and on every machine.

A full block's hash is sha256(parent_hash || tokens || extra_keys) over a canonical
byte encoding (little-endian int64 tokens, length-prefixed extra keys), so the
router, prefill and decode workers and the registry compute the same ids with no
coordination. Python's `hash()` is salted per process and must never be used here.
Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

import numpy as np

BlockHash = bytes  # 32-byte sha256 digest

# the parent of a request's first block; a model namespace can be folded in via
# `extra_keys` so that two models never share cache entries
ROOT_HASH: BlockHash = b"\x00" * 32


def hash_block(parent: BlockHash, tokens: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent)
    h.update(struct.pack("<I", len(tokens)))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    for key in extra_keys:
        data = repr(key).encode()
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.digest()


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    start_block: int = 0,
    parent: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on (each equal to
    hash_block's of that block: the tokens are encoded once for all of them).

    `parent` must be the hash of block `start_block - 1` (ROOT_HASH for block 0), so a
    caller can extend a chain as a sequence grows without rehashing its prefix.
    """
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    data = np.asarray(token_ids[start_block * block_size: num_full * block_size], dtype="<i8").tobytes()
    head, step = struct.pack("<I", block_size), 8 * block_size
    tail = b"".join(struct.pack("<I", len(d)) + d for d in (repr(k).encode() for k in extra_keys))
    hashes: list[BlockHash] = []
    sha = hashlib.sha256
    for at in range(0, len(data), step):
        parent = sha(parent + head + data[at: at + step] + tail).digest()
        hashes.append(parent)
    return hashes


def held_run(hashes: Sequence[BlockHash], holds: Callable[[BlockHash], bool]) -> int:
    """How many of `hashes`, from the first, `holds` is true for: the run a tier can serve of a
    chain (a block past a gap is no use without the ones before it)."""
    n = 0
    while n < len(hashes) and holds(hashes[n]):
        n += 1
    return n
