"""Ray's autoscaler with the fake multi-node provider (configs/fake_multinode.yaml):
growing the decode pool brings decode-type nodes only, the new decode workers serve,
shrinking drains them and the autoscaler retires their idle nodes; the prefill pool
and its node stay the same throughout."""

from __future__ import annotations

import os
import pathlib
import socket
import time

import pytest
import ray

from pdserve import SamplingParams
from pdserve.cluster import Cluster

from helpers import RayHead

pytestmark = pytest.mark.slow  # a real-model or multi-actor cluster per module

ROOT = pathlib.Path(__file__).resolve().parents[2]
PORT = 6379  # fake nodes join the GCS at this port


def node_counts() -> dict[str, int]:
    out = {"prefill": 0, "decode": 0}
    for n in ray.nodes():
        for role in out:
            if n["Alive"] and n["Resources"].get(f"pdserve_{role}"):
                out[role] += 1
    return out


def nodes_offering(role: str) -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(f"pdserve_{role}")}


@pytest.fixture
def fake_cluster(own_ray):
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", PORT)) == 0:
            pytest.fail(f"port {PORT} is in use; the fake multi-node provider needs it for the head's GCS")
    head = RayHead(PORT, "--num-cpus=2", f"--autoscaling-config={ROOT / 'configs/fake_multinode.yaml'}",
                   env={**os.environ, "RAY_FAKE_CLUSTER": "1"})
    c = None
    try:
        c = Cluster.start(address=f"127.0.0.1:{PORT}", serving_config=str(ROOT / "configs/serving/fake.yaml"),
                          max_model_len=256)
        yield c
    finally:
        if c is not None:
            c.shutdown()
        head.stop()  # its fake nodes are its children: the autoscaler started them


def test_decode_pool_grows_its_own_node_type(fake_cluster):
    c = fake_cluster
    # the autoscaler brought a node of each type for the two pools' first workers; on a busy host it
    # may launch a second one of a type while the first still starts (its demand pending over two
    # updates): that one stays idle and is retired after idle_timeout (6 s), as drained nodes are below
    assert c.pool_sizes() == {"prefill": 1, "decode": 1}
    deadline = time.monotonic() + 90
    while node_counts() != {"prefill": 1, "decode": 1} and time.monotonic() < deadline:
        time.sleep(1.0)
    assert node_counts() == {"prefill": 1, "decode": 1}
    hosts = {w.role: w.info.node_id for w in c.workers.values()}
    assert hosts["prefill"] in nodes_offering("prefill") and hosts["decode"] in nodes_offering("decode")
    prefill_ids = {w.worker_id for w in c.workers.values() if w.role == "prefill"}
    prefill_nodes = nodes_offering("prefill")
    first_decode = {w.worker_id for w in c.workers.values() if w.role == "decode"}

    t0 = time.monotonic()
    assert c.scale(decode=3) == {"prefill": 1, "decode": 3}
    grow_s = time.monotonic() - t0
    assert node_counts() == {"prefill": 1, "decode": 3}, "growing decode must add decode nodes only"
    decode_workers = [w for w in c.workers.values() if w.role == "decode"]
    placed = {w.info.node_id for w in decode_workers}
    assert len(placed) == 3 and placed <= nodes_offering("decode")
    assert {w.worker_id for w in c.workers.values() if w.role == "prefill"} == prefill_ids
    assert nodes_offering("prefill") == prefill_nodes

    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = c.generate(["The capital of France is"] * 9, greedy)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len({o.outputs[0].text for o in outs}) == 1 and "Paris" in outs[0].outputs[0].text
    served = {o.decode_worker for o in outs}
    assert served - first_decode, f"no new decode worker served: {served}"
    assert {o.prefill_worker for o in outs} == prefill_ids

    assert c.scale(decode=1) == {"prefill": 1, "decode": 1}
    assert {w.worker_id for w in c.workers.values() if w.role == "decode"} <= {w.worker_id for w in decode_workers}
    assert len(c.registry_workers()) == 2
    # the drained decode nodes go idle and Ray's autoscaler retires them (idle_timeout 6 s)
    deadline = time.monotonic() + 90
    while node_counts()["decode"] > 1 and time.monotonic() < deadline:
        time.sleep(1)
    assert node_counts() == {"prefill": 1, "decode": 1}
    assert nodes_offering("prefill") == prefill_nodes
    assert {w.worker_id for w in c.workers.values() if w.role == "prefill"} == prefill_ids
    assert c.generate("The capital of France is", greedy)[0].outputs[0].text == outs[0].outputs[0].text
    print(f"decode 1 -> 3 with two new fake nodes in {grow_s:.1f} s")
