"""A step's host-side inputs, built once on rank 0 in numpy and sent as they are to tensor-parallel
shards (cheap to pickle).

`token_rows` owns the arithmetic of a batch's new tokens, vectorized over the batch: their ids
(a request's tokens after its computed ones, then its drafts), their cache positions (shifted
back by the tokens a KV window dropped: base/kv_window.py) and their KV slots. `build` lays those out for the step's
path, as one of two types: DECODE as a decode graph's padded rows (`DecodeRows`: one row per query
token, each with its request's block table), PIECES and EAGER as the flat batch (`FlatBatch`: one
block table per sequence); `StepCarry` is what either carries beside its rows. Built in numpy:
a per-row torch tensor costs tens of microseconds on the host, per step, while the GPU waits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from ..core.scheduler import ScheduledRequest
    from ..tiers.offload import TierOps


class StepPath(enum.StrEnum):
    """How a step runs (graphs.StepGraphs.route decides it once per step)."""

    DECODE = "decode"  # a decode graph: every row a decode or verification row
    PIECES = "pieces"  # the piecewise graphs of its token bucket, attention launched between them
    EAGER = "eager"  # kernel by kernel: larger steps, and every step without graphs


@dataclass(kw_only=True)
class StepCarry:
    """What a step carries beside its rows, in either layout: the host tier's copies to apply
    first (tiers/offload.py), the keys to rotate back first (base/kv_window.py) and, rank 0 only,
    the rows whose input token is still on the device (request.PENDING) with each one's row in the
    previous launch's sampled tokens (core/overlap.py)."""

    tier_ops: TierOps | None = None
    kv_shifts: list | None = None
    pending: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class DecodeRows(StepCarry):
    """A decode graph's step: one row per query token (a request with drafts takes k + 1, each
    with the request's block table and its own context length), padded to the graph's size.
    Padding rows store nothing (slot -1) and attend to one token of block 0."""

    path: ClassVar[StepPath] = StepPath.DECODE
    num_rows: int  # real rows
    cols: np.ndarray  # int64 [4, padded]: ids, positions, slots, context lengths
    tables: np.ndarray  # int32 [padded, width]
    sample_rows: np.ndarray  # int64 rows whose logits are sampled

    @property
    def ids(self) -> np.ndarray:
        return self.cols[0]

    def store_nothing(self) -> None:
        """Every row's slot -1 (the warm-up's steps: they write nothing to the cache)."""
        self.cols[2] = -1


@dataclass
class FlatBatch(StepCarry):
    """A PIECES or EAGER step: each sequence's new tokens back to back (`padded`: the token bucket
    whose piecewise graphs run it; 0 eager), one block table per sequence."""

    path: StepPath
    num_rows: int  # sequences
    tables: np.ndarray  # int32 [sequences, max_blocks]
    ids: np.ndarray  # int64 [T] each
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: list[int]
    query_lens: list[int]
    padded: int
    sample_rows: np.ndarray  # int64 rows whose logits are needed
    prompt_rows: np.ndarray  # int64 rows whose logits score a prompt token (after sample_rows)

    def store_nothing(self) -> None:
        self.slots[:] = -1


StepInputs = DecodeRows | FlatBatch


def block_tables(batch: list[ScheduledRequest], width: int) -> np.ndarray:
    """int32 [sequences, width]: each sequence's block ids, zero-padded."""
    tables = np.zeros((len(batch), width), dtype=np.int32)
    for i, s in enumerate(batch):
        tables[i, : len(s.block_ids)] = s.block_ids
    return tables


def token_rows(batch: list[ScheduledRequest], block_size: int,
               tables: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The batch's new tokens back to back: (ids, cache positions, KV slots, each one's sequence).
    A sequence's tokens are those after its computed ones, then its drafts; their cache positions
    are shifted back by what a KV window dropped; slots read `tables` (block_tables)."""
    ks = np.array([s.num_new_tokens for s in batch], dtype=np.int64)
    ids: list[int] = []
    for s in batch:
        start = s.request.num_computed_tokens
        ids += s.request.all_token_ids[start : start + s.num_new_tokens - len(s.draft_token_ids)] + s.draft_token_ids
    cache_first = np.array([s.request.num_computed_tokens - s.request.kv_shift for s in batch], dtype=np.int64)
    seq = np.repeat(np.arange(len(batch)), ks)
    row_first = np.cumsum(ks) - ks
    pos = np.arange(len(ids), dtype=np.int64) - (row_first - cache_first)[seq]
    slots = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return ids, pos, slots, seq


def decode_inputs(batch: list[ScheduledRequest], padded: int, block_size: int, max_blocks: int) -> DecodeRows:
    """The host side of a decode-graph step, `padded` rows with tables `max_blocks` wide."""
    seq_tables = block_tables(batch, max_blocks)
    ids, pos, slots, seq = token_rows(batch, block_size, seq_tables)
    n = len(ids)
    cols = np.zeros((4, padded), dtype=np.int64)
    cols[0, :n], cols[1, :n], cols[2, :n] = ids, pos, slots
    cols[2, n:] = -1
    cols[3] = cols[1] + 1
    tables = np.zeros((padded, max_blocks), dtype=np.int32)
    tables[:n] = seq_tables[seq]
    samples = np.array([s.samples for s in batch], dtype=bool)
    return DecodeRows(n, cols, tables, np.flatnonzero(samples[seq]).astype(np.int64))


def flat_inputs(batch: list[ScheduledRequest], path: StepPath, padded: int, block_size: int) -> FlatBatch:
    """The flat batch of a PIECES or EAGER step: each sequence's new tokens back to back, with
    its context length, its block table, the rows it samples from (its last, or each of its
    k + 1 with drafts) and the rows that score its prompt (prompt_logprobs)."""
    tables = block_tables(batch, max(len(s.block_ids) for s in batch))
    ids, pos, slots, _ = token_rows(batch, block_size, tables)
    seq_lens, query_lens, sample_rows, prompt_rows = [], [], [], []
    row = 0
    for s in batch:
        k, start = s.num_new_tokens, s.request.num_computed_tokens
        seq_lens.append(start - s.request.kv_shift + k)
        query_lens.append(k)
        prompt_rows += [row + p - start for p in s.prompt_positions]
        if s.samples:  # a step with drafts needs the logits at each of its k + 1 tokens
            sample_rows += range(row + k - 1 - len(s.draft_token_ids), row + k)
        row += k
    i64 = np.int64
    return FlatBatch(path, len(batch), tables, np.array(ids, i64), pos, slots, seq_lens, query_lens, padded,
                     np.array(sample_rows, i64), np.array(prompt_rows, i64))


def build(batch: list[ScheduledRequest], path: StepPath, padded: int, block_size: int,
          table_width: int = 0) -> StepInputs:
    """The step's inputs for its path (`padded`: the decode graph's rows or the piecewise token
    bucket; 0 for an eager step; `table_width`: a decode graph's block-table width)."""
    if path == StepPath.DECODE:
        return decode_inputs(batch, padded, block_size, table_width)
    return flat_inputs(batch, path, padded, block_size)
