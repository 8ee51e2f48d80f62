"""GPU, two: the tensor-parallel group's one-shot all-reduce over CUDA IPC buffers
(engine/base/ipc_allreduce.py) between two processes on two GPUs, against NCCL's all-reduce of the
same numbers: eager, across sizes and dtypes, and replayed from a CUDA graph many times with new
inputs. Skipped without two CUDA GPUs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

SHAPES = [((1, 4096), torch.bfloat16), ((64, 4096), torch.bfloat16), ((128, 8192), torch.bfloat16),
          ((3, 5000), torch.float32), ((1, 100), torch.float16), ((7, 4096), torch.bfloat16)]


def _rank(rank: int, address, out) -> None:
    from pdserve.engine.base.tp import TPGroup

    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        tp = TPGroup.serve(2) if rank == 0 else TPGroup(1, 2)
        if rank == 0:
            address.put(tp.address)
        tp.connect(dev, None if rank == 0 else address.get())
        assert tp.oneshot is not None, tp.oneshot_why
        g = torch.Generator(device=dev).manual_seed(rank)
        worst = 0.0
        for _ in range(3):
            for shape, dtype in SHAPES:
                x = torch.randn(shape, generator=g, device=dev).to(dtype)
                want = x.clone()
                tp.dev.allreduce([want]).wait()
                got = tp.all_reduce(x)
                assert got.data_ptr() == x.data_ptr()
                worst = max(worst, (got.float() - want.float()).abs().max().item())
        # captured: three all-reduces of a decode step's sizes in one graph, replayed with new inputs
        xs = [torch.zeros(s, dtype=d, device=dev) for s, d in SHAPES[:3]]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for x in xs:  # warm up (compiles the kernel) outside the capture
                tp.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in xs:
                tp.all_reduce(x)
        for _ in range(50):
            fresh = [torch.randn(x.shape, generator=g, device=dev).to(x.dtype) for x in xs]
            wants = [f.clone() for f in fresh]
            for w in wants:
                tp.dev.allreduce([w]).wait()
            for x, f in zip(xs, fresh):
                x.copy_(f)
            graph.replay()
            for x, w in zip(xs, wants):
                worst = max(worst, (x.float() - w.float()).abs().max().item())
        torch.cuda.synchronize()
        out.put((rank, worst))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        out.close()
        out.join_thread()  # the result written to the pipe before the process ends
        os._exit(0)  # never rely on NCCL's teardown at exit


def test_oneshot_all_reduce_equals_nccl_eager_and_in_a_graph():
    ctx = mp.get_context("spawn")
    address, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, address, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, worst in results.items():
        assert not isinstance(worst, str), f"rank {rank}: {worst}"
        assert worst == 0.0, f"rank {rank}: differs from NCCL by {worst}"  # two ranks: the same sum, rounded once
