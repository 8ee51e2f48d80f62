"""KV handoff between real processes over real gloo groups built at run time."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from pdserve.transfer.base import HandoffMeta

from transfer_workers import (
    Peer,
    handoff,
    killed_sender_fails_its_handoff_and_a_new_one_serves,
    make_kv,
    sender_dying_mid_pull_fails_it_by_name,
)

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(params=["c10d", "pull"])
def peers(request):
    """Worker processes whose pairs move KV over a gloo group ("c10d") or pull it from the peer's
    slab mapped in (same host: transfer/pull.py)."""
    made = []

    def make(name, seed, **kw):
        p = Peer(name, seed, link=request.param, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()


PATTERNS = {
    "one block": ([5], [7]),
    "non-contiguous": ([3, 90, 17, 250, 4], [300, 1, 77, 2, 150]),
    "hundreds, sent in place to a staged receive": (list(range(10, 310)), list(range(399, 99, -1))),
    "runs on both sides (no staging copy)": (list(range(50, 80)), list(range(100, 130))),
    "none (every block a prefix hit): only the meta moves": ([], []),
}


def test_round_trip_bit_exact_for_block_patterns(peers):
    p, d = peers("prefill-0", 1), peers("decode-0", 2)
    src = make_kv(1)
    for i, (name, (src_ids, dst_ids)) in enumerate(PATTERNS.items()):
        handoff(p, d, f"r{i}", src_ids, dst_ids)
        sent = p.get("results")[f"r{i}"]
        (recv, blocks) = d.get("results")
        assert sent[0] == "DONE" and recv[f"r{i}"][0] == "DONE", (name, sent, recv)
        assert recv[f"r{i}"][4] == HandoffMeta(len(src_ids), {f"r{i}": 0.0})  # the meta rode with it
        assert torch.equal(blocks[f"r{i}"], src[src_ids]), name  # bit-exact
        assert recv[f"r{i}"][2] == len(src_ids) * src[0].numel() * 4
    assert d.ask("stats", kind="stats")["pairs"] == 1  # one cached group served every handoff


def test_blocks_of_the_in_place_size_go_one_message_each_bit_exact_and_a_drained_one_keeps_step():
    """Blocks of INPLACE_BLOCK_BYTES (64 KiB: head_dim 128) move over gloo one message a block
    from and into the KV tensor itself: every pattern lands bit-exact, and an order for a
    receive given up on is drained block by block, the next handoff on the same pair intact."""
    from pdserve.transfer.wire import INPLACE_BLOCK_BYTES

    assert make_kv(0, num_blocks=1, head_dim=128)[0].numel() * 4 == INPLACE_BLOCK_BYTES
    p, d = Peer("prefill-0", 5, head_dim=128), Peer("decode-0", 6, head_dim=128)
    try:
        src = make_kv(5, head_dim=128)
        for i, (name, (src_ids, dst_ids)) in enumerate(PATTERNS.items()):
            handoff(p, d, f"r{i}", src_ids, dst_ids)
            assert p.get("results")[f"r{i}"][0] == "DONE", name
            recv, blocks = d.get("results")
            assert recv[f"r{i}"][0] == "DONE", (name, recv)
            assert torch.equal(blocks[f"r{i}"], src[src_ids]), name
        (ch,) = d.ask("channel", (p.name, 1), "channels")
        d.call("recv", {"ops": [(p.name, "", "late", [20, 21, 22], ch, 1.0)]})
        assert d.get("results", timeout=30)[0]["late"][0] == "FAILED"
        p.call("send", {"ops": [(d.name, d.address, "late", [3, 4, 5], ch, 20.0)]})
        assert p.get("results")["late"][0] == "DONE"  # ordered, then drained on the receiver
        handoff(p, d, "next", [9, 2], [40, 41])
        assert p.get("results")["next"][0] == "DONE"
        out, blocks = d.get("results")
        assert out["next"][0] == "DONE" and torch.equal(blocks["next"], src[[9, 2]])
        assert d.ask("stats", kind="stats")["pairs"] == 1
    finally:
        p.stop()
        d.stop()


def test_prompt_handoff_with_partial_block_and_decode_prefix_hits(peers):
    p, d = peers("prefill-0", 11), peers("decode-0", 12)
    shared = list(range(1000, 1048))  # 3 full blocks both sides will share
    first = shared + list(range(7))  # 55 tokens: partial last block
    second = shared + list(range(500, 530))  # 78 tokens
    for rid, tokens in (("a", first), ("b", second)):
        src_all = p.ask("prefill", (rid, tokens), "blocks")
        fill, skip = d.ask("reserve", (rid, tokens), "reserved")
        assert skip == (0 if rid == "a" else 3)  # b: the shared prefix is already on decode
        src = src_all[skip: skip + len(fill)]
        assert len(fill) == len(src) == -(-len(tokens) // 16) - skip
        handoff(p, d, rid, src, fill)
        assert p.get("results")[rid][0] == "DONE"
        out, blocks = d.get("results")
        assert out[rid][0] == "DONE"
        assert torch.equal(blocks[rid], p.ask("blocks_of", src, "tensor"))
        d.ask("cache", rid, "ok")
        p.ask("release", rid, "ok")  # prefill drops its refs; blocks stay cached there
    for rid in ("a", "b"):
        d.ask("release", rid, "ok")
    for peer in (p, d):
        st = peer.ask("stats", kind="stats")
        assert st["used"] == 0 and st["requests"] == []


@pytest.mark.slow
def test_two_by_two_concurrent_handoffs(peers):
    ps = [peers(f"prefill-{i}", 20 + i) for i in range(2)]
    ds = [peers(f"decode-{j}", 30 + j) for j in range(2)]
    srcs = [make_kv(20 + i) for i in range(2)]
    # every prefill sends 3 requests to every decode, all posted at once
    send_ops = {i: [] for i in range(2)}
    recv_ops = {j: [] for j in range(2)}
    expect = {}
    for j, d in enumerate(ds):
        for i, p in enumerate(ps):
            chans = d.ask("channel", (p.name, 3), "channels")
            for k, ch in enumerate(chans):
                rid = f"p{i}-d{j}-{k}"
                src_ids = [(i * 97 + j * 31 + k * 7 + m * 13) % 400 for m in range(8 + k)]
                dst_ids = [200 * i + 60 * k + m for m in range(8 + k)] if j == 0 else \
                    [399 - (200 * i + 60 * k + m) for m in range(8 + k)]
                send_ops[i].append((d.name, d.address, rid, src_ids, ch, 30.0))
                recv_ops[j].append((p.name, "", rid, dst_ids, ch, 30.0))
                expect[rid] = srcs[i][src_ids]
    for j, d in enumerate(ds):
        d.call("recv", {"ops": recv_ops[j]})
    for i, p in enumerate(ps):
        p.call("send", {"ops": list(reversed(send_ops[i]))})  # another order: the sender's is followed
    for p in ps:
        assert all(r[0] == "DONE" for r in p.get("results").values())
    for d in ds:
        out, blocks = d.get("results")
        assert all(r[0] == "DONE" for r in out.values()), out
        for rid, t in blocks.items():
            assert torch.equal(t, expect[rid]), rid


@pytest.mark.slow
def test_peer_that_never_sends_times_out_and_leaks_nothing(peers):
    p, d = peers("prefill-0", 41), peers("decode-0", 42)
    tokens = list(range(40))
    fill, skip = d.ask("reserve", ("r", tokens), "reserved")
    assert d.ask("stats", kind="stats")["used"] == 3
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    t = time.monotonic()
    d.call("recv", {"ops": [(p.name, "", "r", fill, ch, 2.0)]})
    out, _ = d.get("results", timeout=30)
    assert out["r"][0] == "FAILED" and "timed out" in out["r"][1]
    assert time.monotonic() - t < 10
    d.ask("release", "r", "ok")
    assert d.ask("stats", kind="stats")["used"] == 0
    # a receive nobody ordered stalls nothing: the pair goes on
    handoff(p, d, "r2", [1, 2], [3, 4], timeout=20)
    assert p.get("results")["r2"][0] == "DONE"
    assert d.get("results")[0]["r2"][0] == "DONE"


@pytest.mark.slow
def test_killed_peer_fails_cleanly_and_survivor_pairs_with_a_new_one(peers):
    killed_sender_fails_its_handoff_and_a_new_one_serves(peers("prefill-0", 51), peers("decode-0", 52), peers)


def test_a_sender_that_dies_during_a_pull_fails_the_handoff_and_a_new_pair_serves():
    """Same host: the receiver copies from the sender's mapped slab. The sender dies once its
    order is posted, while the copy runs: the receiver finds it gone after the copy, fails the
    handoff by name (what it copied is never used: its blocks are released, not cached) and
    pairs with the replacement, whose blocks arrive bit-exact."""
    p, d = Peer("prefill-0", 81, link="pull"), Peer("decode-0", 82, link="pull")
    p2 = None
    try:
        p2 = sender_dying_mid_pull_fails_it_by_name(p, d, lambda name, seed: Peer(name, seed, link="pull"))
        links = d.ask("links", kind="links")
        ends = {k: (v.pop("local"), v.pop("peer")) for k, v in links.items()}  # both stores' addresses
        assert links == {"prefill-1 recv": {"link": "shared-memory", "gen": 0, "why": "the peer's KV is mapped here",
                                            "liveness": "process"}}
        assert all(a.startswith("127.0.0.1:") and b.startswith("127.0.0.1:") and a != b for a, b in ends.values())
    finally:
        for peer in (p, d, p2):
            if peer is not None:
                peer.stop()


def test_a_pull_without_a_doorbell_polls_and_delivers():
    """A receiver that cannot make the pair's doorbell (another network namespace): both sides
    poll the store for the order and the ack, and the blocks arrive all the same."""
    p, d = Peer("prefill-0", 91, link="pull"), Peer("decode-0", 92, link="pull-no-doorbell")
    try:
        for i, (src, dst) in enumerate((([5], [7]), ([3, 90, 17], [300, 1, 77]))):
            handoff(p, d, f"r{i}", src, dst)
            assert p.get("results")[f"r{i}"][0] == "DONE"
            out, blocks = d.get("results")
            assert out[f"r{i}"][0] == "DONE" and torch.equal(blocks[f"r{i}"], make_kv(91)[src])
        assert d.ask("links", kind="links")["prefill-0 recv"]["link"] == "shared-memory"
    finally:
        p.stop()
        d.stop()


def test_receiver_killed_mid_handoff_sender_releases_everything(peers):
    p, d = peers("prefill-0", 71), peers("decode-0", 72)
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    tokens = list(range(16 * 300))  # 300 blocks, ~1.2 MB: more than the sockets buffer
    src = p.ask("prefill", ("r", tokens), "blocks")
    assert p.ask("stats", kind="stats")["used"] == 300
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    d.call("recv", {"ops": [(p.name, "", "r", list(range(300)), ch, 60.0)], "die": True})
    p.call("send", {"ops": [(d.name, d.address, "r", src, ch, 60.0)]})
    t = time.monotonic()
    state, err, *_ = p.get("results", timeout=90)["r"]
    assert state in ("FAILED", "DONE") and time.monotonic() - t < 30  # DONE only if it all left first
    p.ask("release", "r", "ok")  # the prefill side drops its references either way
    st = p.ask("stats", kind="stats")
    assert st["used"] == 0 and st["requests"] == []
    d.proc.join(10)
    assert d.proc.exitcode == 18


@pytest.mark.slow
def test_sender_side_abort_moves_the_pair_to_a_new_generation(peers):
    p, d = peers("prefill-0", 81), peers("decode-0", 82)
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    # the receiver never posts this one; the sender aborts it mid-send (1.2 MB: it blocks)
    out = p.ask("send_abort", (d.name, d.address, "gone", list(range(300)), ch, 30.0), "results")
    assert out["gone"][0] == "FAILED" and out["gone"][1] == "aborted"
    t = time.monotonic()
    ch2 = handoff(p, d, "next", [5, 6], [7, 8])
    assert ch2.gen == ch.gen + 1  # the receiver saw the sender retire the gen
    assert p.get("results")["next"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["next"][0] == "DONE" and time.monotonic() - t < 10
    assert torch.equal(blocks["next"], make_kv(81)[[5, 6]])


def test_a_send_aborted_on_the_wire_settles_and_the_send_queued_behind_it_lands_on_the_same_gen(peers):
    """A request given up while its KV is on the wire (its client left, or its attempt failed
    elsewhere): aborted with settle, the send finishes its messages and ends "aborted", and the
    pair lives on. Cut instead, the pair failed every send queued behind it, and under a burst
    their retries met the next cut: a whole batch answered with errors."""
    p, d = peers("prefill-0", 85), peers("decode-0", 86)
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    ch, ch_behind = d.ask("channel", (p.name, 2), "channels")
    # "gone" (1.2 MB) waits on the wire for a receiver that never posts it; "behind" queues after it
    p.call("send_abort_settle", {"ops": [(d.name, d.address, "gone", list(range(300)), ch, 30.0),
                                         (d.name, d.address, "behind", [5, 6], ch_behind, 30.0)]})
    assert p.get("abort") == "SETTLING"
    d.call("recv", {"ops": [(p.name, "", "behind", [7, 8], ch_behind, 30.0)]})  # "gone" is drained first
    sent = p.get("results")
    assert sent["gone"][:2] == ("FAILED", "aborted") and sent["behind"][0] == "DONE", sent
    out, blocks = d.get("results")
    assert out["behind"][0] == "DONE" and torch.equal(blocks["behind"], make_kv(85)[[5, 6]])
    assert ch_behind.gen == ch.gen and d.ask("channel", (p.name, 1), "channels")[0].gen == ch.gen  # not retired
    assert p.ask("stats", kind="stats")["pairs"] == 1


@pytest.mark.slow
def test_a_receive_waits_for_a_late_sender_up_to_its_wait_then_for_the_timeout(peers):
    """A burst queues prompts at the prefill worker: a receive, posted when its blocks are
    reserved, waits `wait_s` for its sender's order (the prompt's prefill) and the handoff
    timeout only from there. A sender later than `wait_s` fails it."""
    p, d = peers("prefill-0", 87), peers("decode-0", 88)
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    late, never = d.ask("channel", (p.name, 2), "channels")
    d.call("recv", {"ops": [(p.name, "", "late", [7, 8], late, 1.0, 8.0)]})
    time.sleep(2.5)  # past the 1 s timeout, inside the 8 s wait
    p.call("send", {"ops": [(d.name, d.address, "late", [5, 6], late, 1.0)]})
    assert p.get("results")["late"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["late"][0] == "DONE" and torch.equal(blocks["late"], make_kv(87)[[5, 6]])
    t = time.monotonic()
    d.call("recv", {"ops": [(p.name, "", "never", [9], never, 1.0, 2.0)]})
    out, _ = d.get("results", timeout=30)
    assert out["never"][0] == "FAILED" and "timed out" in out["never"][1]
    assert 1.9 < time.monotonic() - t < 10


def test_a_receive_on_a_gen_the_sender_retired_fails_at_once_and_the_next_channel_moves_on(peers):
    """The race after a burst of aborts: the receiver hands out a channel (gen 0), then the
    sender retires gen 0 (a send aborted on the wire). The send on that channel is refused
    at once; the receive posted on it fails within a second (it waited out its 20 s deadline
    before), and the next channel is a new gen that carries the retry."""
    p, d = peers("prefill-0", 83), peers("decode-0", 84)
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    (ch,) = d.ask("channel", (p.name, 1), "channels")  # handed out before the sender retires the gen
    out = p.ask("send_abort", (d.name, d.address, "gone", list(range(300)), ch, 30.0), "results")
    assert out["gone"][:2] == ("FAILED", "aborted")
    t = time.monotonic()
    d.call("recv", {"ops": [(p.name, "", "next", [7, 8], ch, 20.0)]})
    p.call("send", {"ops": [(d.name, d.address, "next", [5, 6], ch, 20.0)]})
    sent = p.get("results")["next"]
    assert sent[0] == "FAILED" and "stale channel" in sent[1]
    out, _ = d.get("results", timeout=30)
    assert out["next"][0] == "FAILED" and time.monotonic() - t < 5, out
    ch2 = handoff(p, d, "retry", [5, 6], [7, 8])
    assert ch2.gen == ch.gen + 1
    assert p.get("results")["retry"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["retry"][0] == "DONE" and torch.equal(blocks["retry"], make_kv(83)[[5, 6]])


def test_layout_mismatch_is_refused_on_both_sides(peers):
    p, d = peers("prefill-0", 61, head_dim=16), peers("decode-0", 62)
    handoff(p, d, "r", [1], [1], timeout=20)
    sent = p.get("results")["r"]
    out, _ = d.get("results")
    for r in (sent, out["r"]):
        assert r[0] == "FAILED" and "layout mismatch" in r[1] and "head_dim" in r[1]


@pytest.mark.slow
@pytest.mark.parametrize("heads", [None, (0, 2), (1, 2)], ids=["whole blocks", "every head, named", "a head slice"])
def test_order_for_a_receive_given_up_is_drained_and_the_pair_goes_on(peers, heads):
    """The receiver gives up on a handoff (timed out) before its order arrives; the sender
    then sends it, with a head range as TPConnector puts on every send (TP 1 too). The
    receiver drains it into scratch and the next handoff on the same pair lands intact."""
    p, d = peers("prefill-0", 91), peers("decode-0", 92)
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    d.call("recv", {"ops": [(p.name, "", "late", [20, 21, 22], ch, 1.0)]})
    out, _ = d.get("results", timeout=30)
    assert out["late"][0] == "FAILED" and "timed out" in out["late"][1]
    p.call("send", {"ops": [(d.name, d.address, "late", [3, 4, 5], ch, 20.0, heads)]})
    assert p.get("results")["late"][0] == "DONE"  # the order went out and was drained
    handoff(p, d, "next", [7, 8], [30, 31])
    assert p.get("results")["next"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["next"][0] == "DONE", out
    assert torch.equal(blocks["next"], make_kv(91)[[7, 8]])
    assert d.ask("stats", kind="stats")["pairs"] == 1  # the same pair: it never died


def _outside_address() -> str | None:
    """This host's address on its network (not loopback), if it has one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_the_store_listens_only_on_the_address_it_is_given():
    import socket

    from pdserve.transfer.c10d import C10dConnector

    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no address besides loopback")
    conn = C10dConnector("solo", make_kv(1), host="127.0.0.1")
    try:
        port = int(conn.address.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(OSError):  # refused: nobody listens there
            socket.create_connection((outside, port), timeout=5).close()
    finally:
        conn.close()


def test_a_bound_store_closes_its_listening_socket_once():
    """c10d closes the store's listening descriptor when the store goes; dropping the BoundStore
    after that closes nothing else: a socket the process opened meanwhile, which got the same
    number, stays open. (Before, Python's socket object closed the number a second time.)"""
    import gc
    import socket

    from pdserve.engine.base.stores import BoundStore

    bound = BoundStore("127.0.0.1", 5.0)
    n = bound.fd
    bound.store = None  # c10d's store closes its listening socket
    gc.collect()
    other = socket.socket()
    try:
        if other.fileno() != n:
            pytest.skip(f"the new socket got descriptor {other.fileno()}, not the freed {n}")
        del bound
        gc.collect()
        os.fstat(n)  # still open: EBADF before
        other.bind(("127.0.0.1", 0))
    finally:
        other.close()


def test_a_doorbell_reset_by_its_departing_peer_reads_as_the_peer_gone():
    """A peer that ends with one of our rings unread resets the pair's doorbell (ECONNRESET) instead
    of closing it: the waiter fails with the peer gone, as for a close (the reset escaped before)."""
    import socket

    from pdserve.transfer.pull import Bell
    from pdserve.transfer.records import TransferError

    for unread in (False, True):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if unread:
            mine.send(b"!")  # a ring the peer never takes
        theirs.close()
        with pytest.raises(TransferError, match="the peer left"):
            Bell(mine).take(1.0)
        mine.close()


def test_the_doorbell_carries_the_pairs_messages_whole_and_in_order():
    """Control messages over the doorbell (pull.Bell): several in one read, one split across two
    reads, a block-id list of 8K tokens; `take` prefers the doorbell's inbox to the store."""
    import socket

    from pdserve.transfer.pull import Bell, take

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tx, rx = Bell(a), Bell(b)
    big = json.dumps({"rid": "r", "src": list(range(512))})
    assert tx.post("order/0", big) and tx.post("ack/7", "ok")
    line = json.dumps(["order/1", "x" * 10]).encode() + b"\n"
    a.sendall(line[:9])
    deadline = time.monotonic() + 5
    while len(rx.inbox) < 2 and time.monotonic() < deadline:
        rx.take(0.5)
    assert rx.inbox == {"order/0": big, "ack/7": "ok"}
    a.sendall(line[9:])
    rx.take(1.0)
    assert rx.inbox["order/1"] == "x" * 10

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ps = dist.PrefixStore("pd/x/0", store)
    ps.set("order/0", "from the store")
    assert take(ps, "order/0", rx) == big and "order/0" not in rx.inbox  # the doorbell's first
    assert take(ps, "order/0", rx) == "from the store" and take(ps, "order/0", rx) is None  # then deleted
    a.close()
    b.close()
