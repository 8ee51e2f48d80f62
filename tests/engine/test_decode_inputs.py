"""The host side of a CUDA-graph decode step (`decode_inputs`), on CPU: what the graph's
static input tensors receive for each real row and each padding row."""

from __future__ import annotations

import numpy as np

from pdserve.engine.model_runner import decode_inputs
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledRequest


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
    cols, tables = decode_inputs(batch, padded=4, block_size=bs, max_blocks=3)
    assert cols.dtype == np.int64 and tables.dtype == np.int32
    assert cols[0].tolist() == [16, 24, 31, 0]  # input token: the last one
    assert cols[1].tolist() == [5, 3, 0, 0]  # its position
    assert cols[2].tolist() == [2 * bs + 1, 9 * bs + 3, 5 * bs + 0, -1]  # slot; padding stores nothing
    assert cols[3].tolist() == [6, 4, 1, 1]  # context after the step; padding attends to one token
    assert tables.tolist() == [[7, 2, 0], [9, 0, 0], [5, 0, 0], [0, 0, 0]]
