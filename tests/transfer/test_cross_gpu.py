"""GPU, two of one node: the same-node link between processes on different GPUs (the receiver
pulls the sender's blocks over CUDA IPC and NVLink / PCIe peer access, transfer/pull.py), and the
NCCL path the pair takes when the same-node link is off. Bit-exact blocks, the link each pair
names, and a sender that dies mid-handoff on either path: that handoff fails by name and the
receiver serves the next one with a new sender. Skipped with fewer than two CUDA GPUs."""

from __future__ import annotations

import pytest
import torch

from transfer_workers import (
    Peer,
    blocks_arrive_bit_exact,
    killed_sender_fails_its_handoff_and_a_new_one_serves,
    sender_dying_mid_pull_fails_it_by_name,
)

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
    blocks_arrive_bit_exact(p, d)
    row = d.ask("links", kind="links")["prefill-0 recv"]
    assert row["link"] == name
    if link == "pull":  # the sender's process is visible: no store round trip after each copy
        assert row["liveness"] == "process", row


def test_a_sender_that_dies_during_a_pull_across_gpus_fails_it_by_name(peers):
    p, d = peers("prefill-0", 1, "pull", "cuda:0"), peers("decode-0", 2, "pull", "cuda:1")
    sender_dying_mid_pull_fails_it_by_name(p, d, lambda name, seed: peers(name, seed, "pull", "cuda:0"))


def test_a_sender_killed_mid_send_over_nccl_aborts_the_pair_and_a_new_gen_serves(peers):
    p, d = peers("prefill-0", 51, "c10d", "cuda:0"), peers("decode-0", 52, "c10d", "cuda:1")
    killed_sender_fails_its_handoff_and_a_new_one_serves(p, d, lambda name, seed: peers(name, seed, "c10d", "cuda:0"))
    assert d.ask("links", kind="links")["prefill-1 recv"]["link"] == "nccl"
