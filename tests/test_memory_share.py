"""A worker's GPU memory budget is its own share (gpu_memory_utilization x the GPU), whatever
another process on the same GPU holds; shares that cannot fit are refused by name, at start of
the engine (share_budget) and, before any worker starts, for the serving config's pools
(ServingConfig.check_gpu_shares)."""

from __future__ import annotations

import pytest

from pdserve.cluster.spec.serving_config import ServingConfig
from pdserve.engine.exec.kv_cache import NON_TORCH_BYTES, share_budget

GIB = 1 << 30
TOTAL = 140 * GIB


def test_a_second_worker_on_the_gpu_gets_its_own_share():
    """The reported case: two workers at 0.4 on one 140 GiB GPU. The second sees 16 GiB of its
    own (weights) and ~57 GiB held by the first: its budget is 0.4 x 140 less its own, as the
    first's was (the old rule subtracted the first worker's memory: -14 GB)."""
    first = share_budget(0.4, free=TOTAL - 17 * GIB, total=TOTAL, held=16 * GIB, activation_bytes=2 * GIB)
    second = share_budget(0.4, free=TOTAL - 57 * GIB - 17 * GIB, total=TOTAL, held=16 * GIB,
                          activation_bytes=2 * GIB)
    assert first == second == int(0.4 * TOTAL) - 16 * GIB - NON_TORCH_BYTES - 2 * GIB
    assert second > 36 * GIB


def test_a_share_that_is_not_free_is_refused_by_name():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.6 gives this worker 84.0 GiB .* but 66.0 GiB "
                                         r"are free .*add up to at most 1"):
        share_budget(0.6, free=66 * GIB, total=TOTAL, held=16 * GIB, activation_bytes=2 * GIB)


def shares(prefill_gpus: float | None, decode_gpus: float | None, **pools) -> ServingConfig:
    d = {role: {"num_gpus": g, **pools.get(role, {})} for role, g in (("prefill", prefill_gpus),
                                                                      ("decode", decode_gpus))}
    return ServingConfig.from_dict(d).validate()


def test_pools_that_share_a_gpu_within_its_memory_are_accepted():
    shares(0.5, 0.5).check_gpu_shares({"prefill": 0.45, "decode": 0.45})
    shares(0.5, 0.5).check_gpu_shares({"prefill": 0.5, "decode": 0.5})
    shares(1, 1).check_gpu_shares({"prefill": 0.9, "decode": 0.9})  # whole GPUs share nothing
    shares(None, None).check_gpu_shares({"prefill": 0.9, "decode": 0.9})
    shares(0.6, 0.6).check_gpu_shares({"prefill": 0.9, "decode": 0.9})  # one per GPU fits
    # colocated: only the decode pool runs
    shares(0.25, 0.5, decode={"replicas": 2}).check_gpu_shares({"decode": 0.5})


@pytest.mark.parametrize("cfg,util,message", [
    (shares(0.5, 0.5), {"prefill": 0.9, "decode": 0.45},
     "1 prefill worker (num_gpus 0.5, gpu_memory_utilization 0.9) + 1 decode worker (num_gpus 0.5, "
     "gpu_memory_utilization 0.45) = 1.35"),
    (shares(0.5, 0.5, decode={"replicas": 2}), {"prefill": 0.2, "decode": 0.6},
     "2 decode workers (num_gpus 0.5, gpu_memory_utilization 0.6) = 1.20"),
    (shares(0.25, 1, prefill={"replicas": 4}), {"prefill": 0.3, "decode": 0.9},
     "4 prefill workers (num_gpus 0.25, gpu_memory_utilization 0.3) = 1.20"),
])
def test_pools_whose_shares_add_up_past_one_gpu_are_refused_in_one_line(cfg, util, message):
    with pytest.raises(ValueError) as e:
        cfg.check_gpu_shares(util)
    assert str(e.value).startswith("GPU memory shares add up past 1.0 on one GPU: " + message)
    assert "\n" not in str(e.value)


def test_autoscaled_pools_are_checked_at_their_bounds():
    cfg = ServingConfig.from_dict({"prefill": {"num_gpus": 0.5, "max": 2}, "decode": {"num_gpus": 0.5, "max": 1},
                                   "autoscale": {"enabled": True}}).validate()
    with pytest.raises(ValueError, match="2 prefill workers"):
        cfg.check_gpu_shares({"prefill": 0.6, "decode": 0.3})
