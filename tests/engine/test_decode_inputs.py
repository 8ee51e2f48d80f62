"""The host side of a CUDA-graph decode step (`decode_inputs`), on CPU: what the graph's
static input tensors receive for each real row and each padding row."""

from __future__ import annotations

import numpy as np

from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import ScheduledRequest
from pdserve.engine.exec.step_inputs import decode_inputs
from pdserve.engine.sampling_params import SamplingParams


def _decoding(rid: str, tokens: list[int], block_ids: list[int]) -> ScheduledRequest:
    r = Request(rid, tokens[:-1], SamplingParams(temperature=0, max_tokens=8), max_tokens=8)
    r.append_token(tokens[-1])
    r.num_computed_tokens = len(tokens) - 1  # the last token is this step's input
    return ScheduledRequest(r, 1, block_ids)


def test_decode_inputs_rows_and_padding():
    bs = 4
    batch = [_decoding("a", [11, 12, 13, 14, 15, 16], [7, 2]),  # position 5: block 2, offset 1
             _decoding("b", [21, 22, 23, 24], [9]),  # position 3: block 9, offset 3
             _decoding("c", [31], [5])]  # position 0
    d = decode_inputs(batch, padded=4, block_size=bs, max_blocks=3)
    cols, tables, rows = d.cols, d.tables, d.sample_rows
    assert d.num_rows == 3 and d.path == "decode" and (d.ids == cols[0]).all()
    assert rows.tolist() == [0, 1, 2]  # every real row samples
    assert cols.dtype == np.int64 and tables.dtype == np.int32
    assert cols[0].tolist() == [16, 24, 31, 0]  # input token: the last one
    assert cols[1].tolist() == [5, 3, 0, 0]  # its position
    assert cols[2].tolist() == [2 * bs + 1, 9 * bs + 3, 5 * bs + 0, -1]  # slot; padding stores nothing
    assert cols[3].tolist() == [6, 4, 1, 1]  # context after the step; padding attends to one token
    assert tables.tolist() == [[7, 2, 0], [9, 0, 0], [5, 0, 0], [0, 0, 0]]


def test_a_request_with_drafts_takes_a_row_per_query_token():
    """Speculative verification in the graph layout: [last, d1, d2] are three rows at positions
    p, p+1, p+2, each with the request's block table and its own context length."""
    bs = 4
    s = _decoding("a", [11, 12, 13, 14], [7, 2])  # position 3 (block 7, offset 3)
    s.draft_token_ids, s.num_new_tokens = [40, 41], 3
    plain = _decoding("b", [21, 22], [9])
    d = decode_inputs([s, plain], padded=8, block_size=bs, max_blocks=2)
    cols, tables, rows = d.cols, d.tables, d.sample_rows
    assert cols[0, :4].tolist() == [14, 40, 41, 22]
    assert cols[1, :4].tolist() == [3, 4, 5, 1]
    assert cols[2, :5].tolist() == [7 * bs + 3, 2 * bs + 0, 2 * bs + 1, 9 * bs + 1, -1]
    assert cols[3, :4].tolist() == [4, 5, 6, 2]  # row j attends to the first p + j + 1 tokens
    assert tables[:4].tolist() == [[7, 2], [7, 2], [7, 2], [9, 0]] and rows.tolist() == [0, 1, 2, 3]


def test_a_request_past_its_window_takes_its_cache_position():
    """kv_window_tokens (base/kv_window.py): after 8 tokens were evicted, sequence index 13 sits at
    cache position 5 (block 2 of the kept list [7, 2], offset 1) and attends to 6 tokens."""
    bs = 4
    s = _decoding("a", list(range(100, 114)), [7, 2])
    s.request.kv_shift = 8
    d = decode_inputs([s], padded=1, block_size=bs, max_blocks=2)
    cols, tables = d.cols, d.tables
    assert cols[:, 0].tolist() == [113, 5, 2 * bs + 1, 6] and tables.tolist() == [[7, 2]]


def test_the_flat_layout_gives_the_same_tokens_positions_and_slots_as_the_graph_rows():
    """One arithmetic for both layouts (step_inputs.token_rows): drafts, a KV window's shift and
    plain decodes come out the same as a decode graph's real rows and as a flat batch."""
    from pdserve.engine.exec.step_inputs import StepPath, flat_inputs
    bs = 4
    drafted = _decoding("a", [11, 12, 13, 14], [7, 2])
    drafted.draft_token_ids, drafted.num_new_tokens = [40, 41], 3
    shifted = _decoding("b", list(range(100, 114)), [7, 2])
    shifted.request.kv_shift = 8
    batch = [drafted, shifted, _decoding("c", [21, 22], [9])]
    d = decode_inputs(batch, padded=8, block_size=bs, max_blocks=2)
    cols, rows = d.cols, d.sample_rows
    flat = flat_inputs(batch, StepPath.EAGER, 0, bs)
    assert flat.ids.tolist() == cols[0, :5].tolist() == [14, 40, 41, 113, 22]
    assert flat.positions.tolist() == cols[1, :5].tolist() == [3, 4, 5, 5, 1]
    assert flat.slots.tolist() == cols[2, :5].tolist() == [7 * bs + 3, 2 * bs, 2 * bs + 1, 2 * bs + 1, 9 * bs + 1]
    assert flat.seq_lens == [6, 6, 2] and flat.query_lens == [3, 1, 1]
    assert flat.sample_rows.tolist() == rows.tolist() == [0, 1, 2, 3, 4]
