"""GPU, two of one node: the same-node link between processes on different GPUs (the receiver
pulls the sender's blocks over CUDA IPC and NVLink / PCIe peer access, transfer/pull.py), and the
NCCL path the pair takes when the same-node link is off. Bit-exact blocks, the link each pair
names, and a sender that dies mid-handoff on either path: that handoff fails by name and the
receiver serves the next one with a new sender. Skipped with fewer than two CUDA GPUs."""

from __future__ import annotations

import time

import pytest
import torch

from transfer_workers import Peer, handoff, make_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.fixture
def peers():
    made = []

    def start(name, seed, link, device):
        made.append(Peer(name, seed, link=link, device=device))
        return made[-1]

    yield start
    for p in made:
        p.stop()


@pytest.mark.parametrize("link,name", [("pull", "cuda-ipc"), ("c10d", "nccl")])
def test_blocks_cross_gpus_bit_exact_over_the_link_the_pair_names(peers, link, name):
    p, d = peers("prefill-0", 1, link, "cuda:0"), peers("decode-0", 2, link, "cuda:1")
    for i, (src, dst) in enumerate((([5], [7]), ([3, 90, 17, 250, 4], [300, 1, 77, 2, 150]),
                                    (list(range(10, 310)), list(range(399, 99, -1))))):
        handoff(p, d, f"r{i}", src, dst)
        assert p.get("results")[f"r{i}"][0] == "DONE"
        out, blocks = d.get("results")
        assert out[f"r{i}"][0] == "DONE", out
        assert torch.equal(blocks[f"r{i}"], make_kv(1)[src])
    assert d.ask("links", kind="links")["prefill-0 recv"]["link"] == name


def test_a_sender_that_dies_during_a_pull_across_gpus_fails_it_by_name(peers):
    p, d = peers("prefill-0", 1, "pull", "cuda:0"), peers("decode-0", 2, "pull", "cuda:1")
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    d.call("recv", {"ops": [(p.name, "", "r", [20, 21, 22, 23], ch, 30.0)], "slow_pull": 1.0})
    p.call("send", {"ops": [(d.name, d.address, "r", [5, 6, 7, 8], ch, 30.0)], "die_after_order": True})
    p.proc.join(20)
    assert p.proc.exitcode == 19
    out, _ = d.get("results", timeout=60)
    assert out["r"][0] == "FAILED" and "prefill-0 died during the pull of r" in out["r"][1], out
    p2 = peers("prefill-1", 3, "pull", "cuda:0")
    handoff(p2, d, "r2", [9, 8, 7], [10, 11, 12])
    assert p2.get("results")["r2"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["r2"][0] == "DONE" and torch.equal(blocks["r2"], make_kv(3)[[9, 8, 7]])


def test_a_sender_killed_mid_send_over_nccl_aborts_the_pair_and_a_new_gen_serves(peers):
    p, d = peers("prefill-0", 51, "c10d", "cuda:0"), peers("decode-0", 52, "c10d", "cuda:1")
    handoff(p, d, "warm", [1], [1])  # the pair and its NCCL communicator exist
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    fill, _ = d.ask("reserve", ("r", list(range(300))), "reserved")
    t = time.monotonic()
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    d.call("recv", {"ops": [(p.name, "", "r", fill, ch, 60.0)], "forget": (p.name, 2.0)})
    p.call("send", {"ops": [(d.name, d.address, "r", list(range(19)), ch, 60.0)], "die": True})
    p.proc.join(10)
    assert p.proc.exitcode == 17
    out, _ = d.get("results", timeout=90)
    assert out["r"][0] == "FAILED" and "left" in out["r"][1], out
    assert time.monotonic() - t < 30  # at once, not after the 60 s timeout
    d.ask("release", "r", "ok")
    st = d.ask("stats", kind="stats")
    assert st["used"] == 0 and st["pairs"] == 0
    p2 = peers("prefill-1", 53, "c10d", "cuda:0")
    handoff(p2, d, "r3", [9, 8, 7], [10, 11, 12])
    assert p2.get("results")["r3"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["r3"][0] == "DONE" and torch.equal(blocks["r3"], make_kv(53)[[9, 8, 7]])
    assert d.ask("links", kind="links")["prefill-1 recv"]["link"] == "nccl"
