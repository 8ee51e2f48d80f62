"""The same-node handoff in a real Ray cluster on one host: each pair's receiver maps its
sender's KV (a shared memory file on CPU, CUDA IPC on a GPU) and pulls the blocks itself
(transfer/pull.py); `handoff: {same_node: false}` keeps every pair on gloo / NCCL. Tokens
equal the colocated engine's either way (greedy and seeded, bf16 / int8 / int4 KV, with the
decode side's prefix hits), the link is in each worker's status and in the handoff metrics."""

from __future__ import annotations

import gc

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.cluster.spec.serving_config import ServingConfig

from helpers import PROMPTS, role_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=8, ignore_eos=True)
LONG = [p + " Then say it again, in more words than the first time, and then once more." for p in PROMPTS[:3]]


@pytest.mark.parametrize("same_node,kv_dtype,link", [(True, "auto", "shared-memory"), (True, "int8", "shared-memory"),
                                                     (True, "int4", "shared-memory"), (False, "auto", "gloo")])
def test_pairs_on_one_host_pull_kv_and_give_colocated_tokens(tiny_models, same_node, kv_dtype, link):
    model = tiny_models["llama_hd32" if kv_dtype == "int4" else "llama"]
    check_tokens_and_links(model, ServingConfig.from_dict({"handoff": {"same_node": same_node}}), link,
                           kv_cache_dtype=kv_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_a_prefill_and_a_decode_worker_sharing_one_gpu_hand_off_over_cuda_ipc(tiny_models, kv_dtype):
    """Both workers on one GPU (num_gpus 0.5, a third of its memory each): the handoff runs
    over CUDA IPC and gives the colocated engine's tokens (bf16)."""
    model = tiny_models["llama_hd32" if kv_dtype == "int4" else "llama"]
    cfg = ServingConfig.from_dict({"prefill": {"num_gpus": 0.5}, "decode": {"num_gpus": 0.5}})
    check_tokens_and_links(model, cfg, "cuda-ipc", kv_cache_dtype=kv_dtype, gpu_memory_utilization=0.3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("same_node,link", [(True, "cuda-ipc"), (False, "nccl")])
def test_a_pair_on_two_gpus_of_one_node_pulls_over_cuda_ipc(tiny_models, same_node, link):
    """One GPU each (Ray assigns them; each worker still sees the other's: cluster/workers/gpus.py): the
    decode worker maps the prefill worker's KV on the other GPU and pulls it; `same_node: false`
    keeps the pair on NCCL. Tokens equal the colocated engine's either way."""
    cfg = ServingConfig.from_dict({"handoff": {"same_node": same_node}})
    check_tokens_and_links(tiny_models["llama"], cfg, link, gpu_memory_utilization=0.3)


def check_tokens_and_links(model: str, cfg: ServingConfig, link: str, **engine) -> None:
    # one prompt at a time on both sides: on a GPU a decode step's rounding depends on its batch
    # (attention's key splits follow the batch size), so only equal batches give equal bf16 tokens
    one = torch.cuda.is_available()
    with LLM(model, max_model_len=256, **engine) as llm:
        want = {name: [o.outputs[0].token_ids for o in generate(llm, LONG, p, one)]
                for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    c = Cluster.start(model, prefill=1, decode=1, max_model_len=256, serving_config=cfg, **engine)
    try:
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED), ("greedy", GREEDY)):
            outs = generate(c, LONG, params, one)  # the third time the decode side has their prefixes
            assert [o.outputs[0].token_ids for o in outs] == want[name], name
            assert all(role_of(c, o.prefill_worker) == "prefill" for o in outs)
        assert sum(o.num_cached_tokens for o in outs) > 0
        rows = {r["role"]: r for r in c.status()}
        prefill, decode = rows["prefill"]["worker_id"], rows["decode"]["worker_id"]
        assert {k: v["link"] for k, v in rows["decode"]["kv_links"].items()} == {f"{prefill} recv": link}
        assert {k: v["link"] for k, v in rows["prefill"]["kv_links"].items()} == {f"{decode} send": link}
        for row in rows.values():
            assert row["request_blocks"] == 0 and row["inflight"] == 0, row
    finally:
        c.shutdown()


def generate(engine, prompts: list[str], params: SamplingParams, one_at_a_time: bool) -> list:
    if not one_at_a_time:
        return engine.generate(prompts, params)
    return [engine.generate([p], params)[0] for p in prompts]
