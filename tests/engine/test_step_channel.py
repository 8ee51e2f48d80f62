"""The step ring (engine/base/step_channel.py): a tensor-parallel group's step inputs from rank 0
to its shards through shared memory, real processes over a real gloo group on CPU."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from pdserve.engine.base.step_channel import CHECK_S, SLOT_BYTES, SLOTS, StepChannel, process_start
from pdserve.engine.base.tp import TPError, TPGroup

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
CPU = torch.device("cpu")


def _shard(address: str, rank: int, size: int, out) -> None:
    g = TPGroup(rank, size).connect(CPU, address)
    got = []
    while (m := g.recv()) is not None:
        got.append(m)
        time.sleep(0.001 if len(got) % 7 == 0 else 0)  # a slow reader now and then: rank 0 waits for it
    out.put((rank, g.channel is not None, got))
    g.close()
    out.close()
    out.join_thread()


def _messages() -> list:
    small = [{"step": i, "ids": np.arange(i, i + 64, dtype=np.int32)} for i in range(3 * SLOTS + 5)]
    big = {"step": "prefill", "ids": np.arange(SLOT_BYTES, dtype=np.int32)}  # 4 MiB: over gloo
    return small[:5] + [big] + small[5:] + [big, big] + [{"step": "last"}]


def test_step_inputs_reach_every_shard_in_order_through_the_ring_and_long_ones_over_gloo():
    before = set(glob.glob("/dev/shm/pdserve-tp-*"))
    g = TPGroup.serve(3)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_shard, args=(g.address, r, 3, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        g.connect(CPU)
        assert g.channel is not None, g.channel_why
        assert set(glob.glob("/dev/shm/pdserve-tp-*")) == before  # unlinked once every rank mapped it
        msgs = _messages()
        for m in msgs:
            g.send(m)
        g.send(None)
        results = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
        g.close()
    assert [r[:2] for r in results] == [(1, True), (2, True)]
    for _, _, got in results:
        assert len(got) == len(msgs)
        for a, b in zip(got, msgs):
            assert a["step"] == b["step"]
            if "ids" in b:
                assert np.array_equal(a["ids"], b["ids"])


def _rank0_then_die(out, die) -> None:
    g = TPGroup.serve(2)
    out.put(g.address)
    g.connect(CPU)
    g.send({"step": 0})
    die.wait(60)
    os._exit(0)


def test_a_shard_waiting_for_a_step_learns_that_rank_0_died():
    ctx = mp.get_context("spawn")
    out, die = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_rank0_then_die, args=(out, die))
    p.start()
    try:
        g = TPGroup(1, 2).connect(CPU, out.get(timeout=60))
        assert g.channel is not None, g.channel_why
        assert g.recv() == {"step": 0}
        die.set()
        p.join(30)
        t0 = time.monotonic()
        with pytest.raises(TPError, match="tensor-parallel rank 1 of 2: tensor-parallel process .* is gone"):
            g.recv()
        assert time.monotonic() - t0 < 100 * CHECK_S  # seen by the peers' check, not a step's timeout
    finally:
        die.set()
        p.join(10)


def test_a_rank_whose_peers_are_not_visible_cannot_use_the_ring(tmp_path):
    path = str(tmp_path / "ring")
    ch = StepChannel(path, 0, 2, create=True)
    try:
        with pytest.raises(RuntimeError, match="not visible from this one"):
            ch.watch([f"{os.getpid()} {process_start(os.getpid())}x"])  # this pid, another start: another process
    finally:
        ch.close()
