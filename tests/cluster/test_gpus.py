"""A GPU actor's view of its node's GPUs (cluster/workers/gpus.py): Ray accounts and assigns the GPUs,
the actor sees its own first and the node's others after, so a same-node pair on two GPUs can open
each other's CUDA IPC handles. Real Ray actors on a Ray started with two (logical) GPUs: Ray
assigns their IDs exactly as on a GPU node; CUDA itself is not needed to check the view."""

from __future__ import annotations

import os

import pytest
import ray

from pdserve.cluster.workers.gpus import runtime_env, see_node_gpus, visible_order


def test_own_gpus_first_then_the_node_in_its_order():
    assert visible_order(["2"], None, 4) == ["2", "0", "1", "3"]
    assert visible_order(["1", "3"], None, 4) == ["1", "3", "0", "2"]
    # the node's Ray started with CUDA_VISIBLE_DEVICES: Ray's IDs are its entries
    assert visible_order(["5"], "4,5,6", 8) == ["5", "4", "6"]
    assert visible_order(["GPU-b"], "GPU-a, GPU-b", 0) == ["GPU-b", "GPU-a"]
    assert visible_order(["0"], None, 0) == ["0"]  # the node's count unknown: its own only


class Probe:
    def view(self, choose: bool):
        chose = see_node_gpus() if choose else None
        return chose, ray.get_runtime_context().get_accelerator_ids()["GPU"], os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def two_gpu_ray(own_ray):
    from pdserve.cluster.health.local_ray import ray_init_options, ray_on_loopback

    opts = ray_init_options()
    opts["runtime_env"]["env_vars"] = {**opts["runtime_env"]["env_vars"], "CUDA_VISIBLE_DEVICES": "0,1"}
    with ray_on_loopback():
        ray.init(address="local", namespace="pdserve-gpus", num_gpus=2, num_cpus=2, **opts)
    yield
    ray.shutdown()


def test_actors_see_their_own_gpu_first_and_the_nodes_other(two_gpu_ray):
    cls = ray.remote(Probe).options(num_gpus=1, num_cpus=0, runtime_env=runtime_env())
    a, b = cls.remote(), cls.remote()
    views = ray.get([a.view.remote(True), b.view.remote(True)])
    assigned = sorted(v[1][0] for v in views)
    assert assigned == ["0", "1"]  # Ray still assigns (and accounts) one GPU each
    for chose, (own,), env in views:
        assert chose == env == f"{own},{1 - int(own)}"  # its own first, the other visible after it
    assert ray.available_resources().get("GPU", 0) == 0
    # without the runtime_env Ray narrows the view to the assigned GPU, and the actor keeps it
    ray.kill(a)
    c = ray.remote(Probe).options(num_gpus=1, num_cpus=0).remote()
    chose, (own,), env = ray.get(c.view.remote(True))
    assert chose is None and env == own
