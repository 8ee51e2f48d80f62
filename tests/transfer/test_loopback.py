"""The in-process loopback backend: same state machine, for unit tests of the roles."""

import time

import torch

from pdserve.transfer import HandoffTarget, TransferState
from pdserve.transfer.base import HandoffMeta
from pdserve.transfer.loopback import LoopbackConnector, LoopbackHub


def kv(seed, head_dim=8):
    return torch.randn(32, 2, 2, 16, 2, head_dim, generator=torch.Generator().manual_seed(seed))


def test_loopback_moves_blocks_and_checks_layout():
    hub = LoopbackHub()
    p, d = LoopbackConnector("p", kv(1), hub), LoopbackConnector("d", kv(2), hub)
    ch = d.new_channel("p")
    r = d.start_recv("p", "a", [5, 9], ch)
    assert r.state == TransferState.WAITING and d.poll() == []
    s = p.start_send(HandoffTarget("d", d.address, ch, 0), "a", [3, 4], meta=HandoffMeta(7))
    assert s.state == r.state == TransferState.DONE and r.meta == HandoffMeta(7)
    assert torch.equal(d.kv[[5, 9]], p.kv[[3, 4]])
    assert d.poll() == [r] and p.poll() == [s]
    odd = LoopbackConnector("q", kv(3, head_dim=4), hub)
    ch = d.new_channel("q")
    r = d.start_recv("q", "b", [1], ch)
    s = odd.start_send(HandoffTarget("d", d.address, ch, 0), "b", [1])
    assert r.state == s.state == TransferState.FAILED and "head_dim" in r.error


def test_loopback_timeout_and_abort():
    hub = LoopbackHub()
    d = LoopbackConnector("d", kv(2), hub)
    r = d.start_recv("p", "a", [1], d.new_channel("p"), timeout_s=0.05)
    time.sleep(0.1)
    assert d.poll() == [r] and r.state == TransferState.FAILED and "timed out" in r.error
    r = d.start_recv("p", "b", [1], d.new_channel("p"))
    assert d.abort("b") and r.error == "aborted" and not d.abort("b")


def test_a_handoff_meta_survives_the_json_a_connector_carries():
    """Log-prob maps keyed by token id come back keyed by int (JSON keys would be strings), a
    prompt position without log-probs stays None, and absent fields stay absent."""
    import json

    from pdserve.transfer.base import HandoffMeta
    full = HandoffMeta(42, {"send_start": 1.5}, first_logprobs={42: -0.1, 7: -2.5},
                       prompt_logprobs=[None, {3: -1.0, 9: -4.0}], prompt_ranks=[1, 2])
    assert HandoffMeta.from_wire(json.loads(json.dumps(full.to_wire()))) == full
    bare = HandoffMeta(5)
    assert bare.to_wire() == {"first_token": 5, "spans": {}}
    assert HandoffMeta.from_wire(json.loads(json.dumps(bare.to_wire()))) == bare
