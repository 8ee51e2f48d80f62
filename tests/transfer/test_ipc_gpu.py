"""GPU: the same-node link over CUDA IPC between two processes sharing one GPU (NCCL refuses two
ranks on one device): the receiver pulls the sender's blocks from its KV mapped in
(transfer/pull.py). Bit-exact blocks, a sender that dies during a pull, and memory after 1,000
handoffs back where it started. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from transfer_workers import Peer, blocks_arrive_bit_exact, handoff, sender_dying_mid_pull_fails_it_by_name

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def pair():
    made = [Peer("prefill-0", 1, link="pull", device="cuda"), Peer("decode-0", 2, link="pull", device="cuda")]
    yield made
    for p in made:
        p.stop()


def test_blocks_pulled_over_cuda_ipc_are_bit_exact(pair):
    p, d = pair
    blocks_arrive_bit_exact(p, d)
    assert d.ask("links", kind="links")["prefill-0 recv"]["link"] == "cuda-ipc"


def test_a_sender_that_dies_during_a_pull_fails_it_and_the_receiver_keeps_serving(pair):
    """The sender dies once its order is posted, while the receiver copies from its mapped KV:
    the receiver's CUDA context survives, the handoff fails by name, a new sender serves."""
    p, d = pair

    def new_peer(name, seed):
        pair.append(Peer(name, seed, link="pull", device="cuda"))
        return pair[-1]

    sender_dying_mid_pull_fails_it_by_name(p, d, new_peer)


def test_memory_after_1000_handoffs_is_where_it_started(pair):
    p, d = pair
    handoff(p, d, "warm", list(range(16)), list(range(100, 116)))
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    before = {x.name: x.ask("memory", kind="memory") for x in (p, d)}
    g = torch.Generator().manual_seed(0)
    for i in range(1000):
        src = torch.randperm(400, generator=g)[:8].tolist()
        dst = torch.randperm(400, generator=g)[:8].tolist()
        handoff(p, d, f"m{i}", src, dst)
        assert p.get("results")[f"m{i}"][0] == "DONE"
        assert d.get("results")[0][f"m{i}"][0] == "DONE"
    after = {x.name: x.ask("memory", kind="memory") for x in (p, d)}
    for name in before:
        assert after[name][0] == before[name][0], (name, before[name], after[name])  # torch's allocations
    assert abs(after[p.name][1] - before[p.name][1]) <= 64 << 20, (before, after)  # the GPU's free memory
