"""Copying KV blocks between two block-major slabs by block id, in one launch: the same-node
handoff's pull (transfer/pull.py), where the source is another process's KV mapped into this
one (CUDA IPC, the same GPU or a peer GPU of the node) and the destination this worker's.

    copy_blocks(dst, dst_ids, src, src_ids, dst_heads=None, src_heads=None)

Both slabs are [num_blocks, layers, 2, block_size, kv_heads, row] (row: head_dim values, or a
quantized row's bytes with its scales: ops/kv_quant.py), so every block is `layers x 2 x
block_size` rows of `kv_heads x row` contiguous elements. Whole blocks copy as one contiguous
run each; a head slice (tensor parallel: heads [lo, hi) of one side into [lo', hi') of the
other, equally wide) copies its contiguous part of every row. On CUDA a Triton kernel reads the
source once and writes the destination once (no staging buffer); on CPU the torch path does
the same with one indexed assignment, and the kernel runs there under TRITON_INTERPRET=1 in
the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16384  # elements one program copies (32 KiB of bf16)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, rows, width, src_block, dst_block,
                        src_row, dst_row, src_off, dst_off, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # program (block i x row r, chunk c): elements [c x CHUNK, (c + 1) x CHUNK) of that row's run
    pid = tl.program_id(0).to(tl.int64)
    i = pid // rows
    r = pid % rows
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    src = src_ptr + s * src_block + r * src_row + src_off
    dst = dst_ptr + d * dst_block + r * dst_row + dst_off
    start = tl.program_id(1).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    for c in range(0, CHUNK, BLOCK):
        o = start + c + offs
        m = o < width
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def _row_run(kv: torch.Tensor, heads: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(rows per block, elements of the run in each row, row stride, the run's offset in its row)."""
    lo, hi = heads if heads is not None else (0, kv.shape[4])
    return kv.shape[1] * kv.shape[2] * kv.shape[3], (hi - lo) * kv.shape[5], kv.shape[4] * kv.shape[5], \
        lo * kv.shape[5]


def _whole(kv: torch.Tensor, heads: tuple[int, int] | None) -> bool:
    return heads is None or tuple(heads) == (0, kv.shape[4])


def copy_blocks(dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor, src_ids: torch.Tensor,
                dst_heads: tuple[int, int] | None = None, src_heads: tuple[int, int] | None = None,
                use_triton: bool | None = None, block: int = 1024, num_warps: int = 4) -> None:
    """dst[dst_ids[i]] (its heads dst_heads) = src[src_ids[i]] (its heads src_heads), for every i;
    ids are int64 tensors on the slabs' device. Queued on the current stream (CUDA). `block`
    (elements one load of a program moves, a power of two <= CHUNK) and `num_warps` tune the
    kernel (bench/transfer_bench.py --kernel-sweep: reads and writes of a peer GPU's memory)."""
    if src.dtype != dst.dtype or src.shape[1:4] != dst.shape[1:4] or src.shape[5] != dst.shape[5]:
        raise ValueError(f"blocks of {tuple(src.shape[1:])} {src.dtype} do not fit blocks of "
                         f"{tuple(dst.shape[1:])} {dst.dtype}")
    if _whole(src, src_heads) and _whole(dst, dst_heads) and src.shape[4] == dst.shape[4]:
        runs = ((1, src[0].numel(), 0, 0), (1, dst[0].numel(), 0, 0))  # a block is one run
    else:
        runs = (_row_run(src, src_heads), _row_run(dst, dst_heads))
    (rows, width, s_row, s_off), (_, d_width, d_row, d_off) = runs
    if width != d_width:
        raise ValueError(f"head slices differ in width: source {src_heads} of {src.shape[4]} heads, "
                         f"destination {dst_heads} of {dst.shape[4]}")
    n = dst_ids.numel()
    if n != src_ids.numel():
        raise ValueError(f"{src_ids.numel()} source blocks for {n} destination blocks")
    if not n:
        return
    if use_triton is None:
        use_triton = dst.device.type == "cuda"
    if not use_triton:
        s = src.view(src.shape[0], rows, -1)[src_ids, :, s_off:s_off + width]
        dst.view(dst.shape[0], rows, -1)[dst_ids, :, d_off:d_off + width] = s
        return
    grid = (n * rows, triton.cdiv(width, CHUNK))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, rows, width, src[0].numel(), dst[0].numel(),
                              s_row, d_row, s_off, d_off, CHUNK=CHUNK, BLOCK=block, num_warps=num_warps)
