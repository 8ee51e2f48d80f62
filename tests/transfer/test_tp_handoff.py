"""Handoffs between tensor-parallel workers of different sizes: the routes (exact), and
real gloo pairs between per-rank C10dConnectors (ranks in this process, LocalRankLink)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve.engine.base.tp import kv_head_range
from pdserve.transfer.base import HandoffMeta, TransferState
from pdserve.transfer.c10d import C10dConnector
from pdserve.transfer.tp import LocalRankLink, Route, TPConnector, rank_name, routes

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

NB, LAYERS, BS, DIM = 12, 2, 4, 8


def test_routes_split_heads_one_holder_each():
    assert routes(4, 1, 2) == [Route(0, 0, (0, 2), (0, 2)), Route(0, 1, (2, 4), (0, 2))]
    assert routes(4, 2, 1) == [Route(0, 0, (0, 2), (0, 2)), Route(1, 0, (0, 2), (2, 4))]
    assert routes(4, 2, 4) == [Route(0, 0, (0, 1), (0, 1)), Route(0, 1, (1, 2), (0, 1)),
                               Route(1, 2, (0, 1), (0, 1)), Route(1, 3, (1, 2), (0, 1))]
    assert routes(4, 1, 1) == [Route(0, 0, (0, 4), (0, 4))]


def test_routes_replicated_heads_share_the_sending():
    # 2 KV heads over 4 ranks: ranks 0,1 hold head 0 and ranks 2,3 head 1
    assert routes(2, 4, 1) == [Route(0, 0, (0, 1), (0, 1)), Route(2, 0, (0, 1), (1, 2))]
    assert routes(2, 4, 2) == [Route(0, 0, (0, 1), (0, 1)), Route(3, 1, (0, 1), (0, 1))]
    assert routes(2, 4, 4) == [Route(0, 0, (0, 1), (0, 1)), Route(1, 1, (0, 1), (0, 1)),
                               Route(2, 2, (0, 1), (0, 1)), Route(3, 3, (0, 1), (0, 1))]
    assert routes(2, 1, 4) == [Route(0, d, (d // 2, d // 2 + 1), (0, 1)) for d in range(4)]


@pytest.mark.parametrize("heads,p,d", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 4, 2), (1, 2, 4), (8, 4, 4)])
def test_every_receiver_head_comes_from_exactly_one_holder(heads, p, d):
    got = {}
    for r in routes(heads, p, d):
        slo, dlo = kv_head_range(heads, p, r.src)[0], kv_head_range(heads, d, r.dst)[0]
        assert r.src_heads[1] - r.src_heads[0] == r.dst_heads[1] - r.dst_heads[0]
        for i in range(r.dst_heads[1] - r.dst_heads[0]):
            key = (r.dst, r.dst_heads[0] + i)
            assert key not in got
            got[key] = slo + r.src_heads[0] + i
            assert got[key] == dlo + r.dst_heads[0] + i  # the same global head
    want = {(dr, i) for dr in range(d) for i in range(kv_head_range(heads, d, dr)[1] - kv_head_range(heads, d, dr)[0])}
    assert set(got) == want


def worker(name: str, tp: int, heads: int, full: torch.Tensor | None) -> TPConnector:
    """A TP worker's connectors: rank r holds its heads of `full` (zeros when None)."""
    conns = []
    for r in range(tp):
        lo, hi = kv_head_range(heads, tp, r)
        kv = torch.zeros(NB, LAYERS, 2, BS, hi - lo, DIM) if full is None else full[..., lo:hi, :].clone()
        conns.append(C10dConnector(rank_name(name, r), kv, tp=tp, kv_heads_total=heads, default_timeout_s=20))
    return TPConnector(conns[0], [LocalRankLink(c) for c in conns[1:]], heads)


def rank_kv(conn: TPConnector, r: int) -> torch.Tensor:
    return (conn.local if r == 0 else conn.links[r - 1].connector).kv


def wait(*handoffs_and_conns, timeout=30.0):
    hs, conns = handoffs_and_conns[0], handoffs_and_conns[1:]
    t0 = time.monotonic()
    while not all(h.state.finished for h in hs) and time.monotonic() - t0 < timeout:
        for c in conns:
            c.poll()
        time.sleep(0.002)


@pytest.mark.parametrize("heads,p,d", [(4, 1, 2), (4, 2, 1), (2, 1, 4), (2, 4, 2)])
def test_handoff_between_tp_sizes_lands_every_head(heads, p, d):
    torch.manual_seed(0)
    full = torch.randn(NB, LAYERS, 2, BS, heads, DIM)
    src, dst = worker("pre", p, heads, full), worker("dec", d, heads, None)
    dst.peer_tp["pre"] = p
    try:
        src_ids, dst_ids = [3, 7, 1, 9], [0, 5, 6, 11]  # the first block is a prefix hit
        recv, target = dst.receive("pre", "r1", dst_ids[1:], num_skip=1)
        assert target.tp == d
        send = src.start_send(target, "r1", src_ids[1:], meta=HandoffMeta(42))
        wait([recv, send], src, dst)
        assert (send.state, recv.state) == (TransferState.DONE, TransferState.DONE), (send.error, recv.error)
        assert recv.meta == HandoffMeta(42)
        for r in range(d):
            lo, hi = kv_head_range(heads, d, r)
            got = rank_kv(dst, r)
            assert torch.equal(got[dst_ids[1:]], full[src_ids[1:]][..., lo:hi, :])
            assert not got[[0, 1, 2]].any()  # the prefix hit and the other blocks are untouched
    finally:
        for c in (src, dst):
            for r in range(c.size):
                (c.local if r == 0 else c.links[r - 1].connector).close()


def test_a_handoff_ends_when_its_routes_land_not_when_a_poll_notices():
    """The decode loop polls between steps: a handoff's end (its `finished_at`, the timeline's
    recv_done) is when its blocks landed, so the wait for the poll counts as pickup, not transfer."""
    heads = 4
    full = torch.randn(NB, LAYERS, 2, BS, heads, DIM)
    src, dst = worker("pre", 1, heads, full), worker("dec", 1, heads, None)
    dst.peer_tp["pre"] = 1
    try:
        recv, target = dst.receive("pre", "r1", [2, 3], num_skip=0)
        send = src.start_send(target, "r1", [5, 6], meta=HandoffMeta(1))
        t0 = time.monotonic()
        while not all(h.state.finished for h in recv.local + send.local) and time.monotonic() - t0 < 30:
            time.sleep(0.002)  # nobody polls: the routes end on their pairs' threads
        landed = max(h.finished_at for h in recv.local)
        time.sleep(0.3)
        before_poll = time.monotonic()
        wait([recv, send], src, dst)
        assert (recv.state, send.state) == (TransferState.DONE, TransferState.DONE), (recv.error, send.error)
        assert recv.finished_at == landed < before_poll - 0.25
        assert send.finished_at == max(h.finished_at for h in send.local) < before_poll - 0.25
    finally:
        for c in (src, dst):
            c.local.close()


@pytest.mark.slow
def test_a_failing_route_fails_the_handoff_and_aborts_the_rest():
    heads = 4
    full = torch.randn(NB, LAYERS, 2, BS, heads, DIM)
    src, dst = worker("pre", 2, heads, full), worker("dec", 2, heads, None)
    dst.peer_tp["pre"] = 2
    try:
        recv, target = dst.receive("pre", "r2", [1, 2], num_skip=0, timeout_s=3)
        # only rank 0's route is sent: rank 1's never arrives, so its receive times out
        rank0 = target.ranks[0]
        part = src.local.start_send(target.__class__(rank0.name, rank0.address, target.channel, 0), "r2#0.0", [4, 5],
                                    heads=(0, 2))
        wait([recv], dst, src, timeout=15)
        assert recv.state == TransferState.FAILED and "r2#1.1" in recv.error, recv.error
        assert dst.num_pending == 0 and part.state == TransferState.DONE
        # the pairs still work: a full handoff afterwards lands
        recv, target = dst.receive("pre", "r3", [1, 2], num_skip=0)
        send = src.start_send(target, "r3", [4, 5])
        wait([recv, send], src, dst)
        assert recv.state == TransferState.DONE, recv.error
        assert torch.equal(rank_kv(dst, 1)[[1, 2]], full[[4, 5]][..., 2:4, :])
    finally:
        for c in (src, dst):
            for r in range(c.size):
                (c.local if r == 0 else c.links[r - 1].connector).close()


def test_different_kv_cache_dtypes_are_refused_at_pairing():
    """int8 and fp8 slabs have the same bytes (engine/ops/kv_quant.py): the layouts name the dtype."""
    raw = torch.zeros(NB, LAYERS, 2, BS, 2, DIM + 16, dtype=torch.uint8)
    src = C10dConnector("pre", raw.clone(), kv_cache_dtype="int8", default_timeout_s=10)
    dst = C10dConnector("dec", raw.clone(), kv_cache_dtype="fp8", default_timeout_s=10)
    try:
        recv, target = dst.receive("pre", "r1", [1, 2], 0)
        send = src.start_send(target, "r1", [3, 4])
        wait([recv, send], src, dst, timeout=20)
        assert recv.state == send.state == TransferState.FAILED
        for h in (recv, send):
            assert "KV cache dtypes differ" in h.error and "--kv-cache-dtype" in h.error, h.error
    finally:
        src.close()
        dst.close()
