"""Each pool's engine spec (cluster/spec/engine_specs.py): parsed and resolved against the model once,
where the cluster starts; what crosses to a worker is that spec, and the worker neither parses
an argument nor reads the model's config again."""

from __future__ import annotations

import os
import pickle

import pytest

from pdserve.cluster.pools.pools import Pools
from pdserve.cluster.spec.cluster_spec import ClusterSpec
from pdserve.cluster.spec.engine_specs import PREFILL_CHUNK_TOKENS, EngineSpecs
from pdserve.cluster.spec.serving_config import ServingConfig


def test_each_pool_gets_its_spec_resolved_once_and_the_device_part_is_left_to_the_worker(tiny_models, tmp_path):
    import shutil

    model = str(tmp_path / "m")
    shutil.copytree(tiny_models["llama"], model)
    specs = EngineSpecs.of(ServingConfig(), "hybrid", {"model": model, "max_model_len": 128, "max_num_seqs": 8})
    # hybrid decode workers prefill with the prefill pool's chunk budget
    assert specs.prefill.max_num_batched_tokens == specs.decode.max_num_batched_tokens == PREFILL_CHUNK_TOKENS
    assert specs.decode.model_config.num_layers == 2 and specs.decode.max_model_len == 128
    # fused ops depend on the GPU the worker holds, not on where the cluster starts
    assert specs.decode.fused_ops is None
    sent = pickle.loads(pickle.dumps(specs.decode))  # what a worker receives
    os.remove(os.path.join(model, "config.json"))  # read again, it would fail
    assert sent.resolve(model).model_config == specs.decode.model_config
    assert sent.fused_ops is False  # this process's device: a CPU
    with pytest.raises(ValueError, match="has no config.json"):  # a spec not yet resolved reads it
        EngineSpecs.of(ServingConfig(), "hybrid", {"model": model})


@pytest.mark.parametrize("mode", ["hybrid", "disaggregated", "colocated"])
def test_only_the_workers_that_decode_check_their_room_for_a_decode_batch(tiny_models, mode):
    """decode_batch_len reaches the decode pool (hybrid's too, whose args are the prefill pool's)
    and colocated engines; a prefill worker holds no decode batch and does not check it."""
    specs = EngineSpecs.of(ServingConfig(), mode, {"model": tiny_models["llama"], "max_model_len": 128,
                                                   "decode_batch_len": 100})
    assert specs.decode.decode_batch_len == 100
    assert specs.prefill is None if mode == "colocated" else specs.prefill.decode_batch_len is None


def test_a_worker_spec_takes_the_slo_as_it_is_now_and_a_missing_pool_is_named(tiny_models):
    serving = ServingConfig.from_dict({"slo": {"tpot_s": 0.03}})
    specs = EngineSpecs.of(serving, "colocated", {"model": tiny_models["llama"], "max_model_len": 128,
                                                  "kv_offloading_size": 0.001, "kv_persist_dir": "/persist"})
    assert specs.prefill is None and specs.tp("prefill") == 1
    pools = Pools(ClusterSpec(serving, specs, namespace="ns", start_timeout=1.0), {"prefill": {}, "decode": {}}, None)
    assert pools.spec("decode").slo_tpot_s == 0.03
    serving.slo.tpot_s = 0.02  # POST /admin/slo: the next worker starts with it
    spec = pools.spec("decode", kv_persist_dir="/persist/colocated-0")
    assert (spec.slo_tpot_s, spec.kv_persist_dir) == (0.02, "/persist/colocated-0")
    assert specs.decode.slo_tpot_s is None and spec.model_config is specs.decode.model_config
    with pytest.raises(ValueError, match="a colocated cluster has no prefill pool"):
        pools.spec("prefill")


def test_an_unknown_or_bad_engine_argument_is_refused_before_anything_starts(tiny_models):
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        EngineSpecs.of(ServingConfig(), "disaggregated", {"model": tiny_models["llama"], "max_num_seq": 8})
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        EngineSpecs.of(ServingConfig(), "disaggregated", {"model": tiny_models["llama"], "max_model_len": 100000},
                       {"max_num_batched_tokens": 512})


def test_a_cluster_spec_is_parsed_once_from_its_arguments_and_its_pools_read_their_values_there(tiny_models,
                                                                                                 tmp_path):
    """ClusterSpec.of: the serving config (a file), explicit sizes over its replicas, each pool's
    engine spec, the mode's alias, the placement rules; refusals name the argument before Ray.
    A worker's free seats come from its pool's spec (max_num_seqs), not from its stats."""
    from pdserve.cluster.records import WorkerRecord, WorkerStats

    path = tmp_path / "pools.yaml"
    path.write_text("prefill: {replicas: 1}\ndecode: {replicas: 1}\nslo: {ttft_s: 1.5}\n")
    spec = ClusterSpec.of(tiny_models["llama"], prefill=2, decode=3, mode="disagg", serving_config=str(path),
                          local_prefill_tokens=64, max_model_len=128, max_num_seqs=6, namespace="spec-ns")
    assert (spec.mode, spec.namespace, spec.address, spec.placement.prefill_tokens) == \
        ("disaggregated", "spec-ns", None, 64)
    assert (spec.serving.prefill.replicas, spec.serving.decode.replicas, spec.serving.slo.ttft_s) == (2, 3, 1.5)
    assert spec.engines.prefill.max_num_batched_tokens == PREFILL_CHUNK_TOKENS
    assert spec.engines.decode.max_num_seqs == 6 and spec.engines.decode.model_config.num_layers == 2
    pools = Pools(spec, {"prefill": {}, "decode": {}}, None)
    assert (pools.cluster_spec, pools.namespace, pools.start_timeout) == (spec, "spec-ns", 900.0)
    pools.workers["decode-0"] = WorkerRecord("decode-0", "decode", None, stats=WorkerStats(num_running=1))
    assert [c.seats for c in pools.candidates("decode")] == [6 - 1 - 4]
    with pytest.raises(ValueError, match="mode must be one of disaggregated, hybrid, colocated"):
        ClusterSpec.of(tiny_models["llama"], mode="split")
    with pytest.raises(ValueError, match="colocated mode has no prefill pool"):
        ClusterSpec.of(tiny_models["llama"], prefill=1, mode="colocated")
    with pytest.raises(TypeError, match="unknown engine argument"):
        ClusterSpec.of(tiny_models["llama"], max_num_seq=8)
