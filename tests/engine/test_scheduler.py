"""Scheduler on CPU with integer block ids only: token budget, chunked prefill,
max_num_seqs, preemption by recompute."""

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True):
    kv = KVCacheManager(num_blocks, 4)
    return kv, Scheduler(kv, max_seqs, budget, chunked)


def req(rid, n, base=0):
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=8), max_tokens=8)


def fake_step(s):
    """Runs one schedule/update cycle, appending a token to each request that samples."""
    out = s.schedule()
    sampling = [x.request for x in out.scheduled if x.samples]
    s.update_after_step(out)
    for r in sampling:
        r.append_token(7)
    return out


def test_chunked_prefill_respects_budget():
    kv, s = make(budget=10)
    a, b = req("a", 25), req("b", 6, base=100)
    s.add(a)
    s.add(b)
    out = fake_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10)]
    out = fake_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10)]
    out = fake_step(s)  # a's last 5 tokens, then b's first 5
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 5), ("b", 5)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    out = fake_step(s)  # a decodes 1, b finishes its prompt
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1)]
    for r in (a, b):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    kv.check_all_free()


def test_no_chunking_waits_for_a_whole_prompt():
    kv, s = make(budget=10, chunked=False)
    s.add(req("a", 8))
    s.add(req("b", 8, base=50))
    out = fake_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a"]


def test_max_num_seqs():
    kv, s = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 3, base=10 * i))
    out = fake_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_frees_newest_and_recomputes():
    kv, s = make(num_blocks=4, budget=64)  # 16 token slots
    a, b = req("a", 7), req("b", 7, base=100)
    s.add(a)
    s.add(b)
    fake_step(s)  # each holds 2 blocks, all 4 used
    assert kv.num_free_blocks == 0
    fake_step(s)  # position 7 fits in each request's second block
    out = fake_step(s)  # position 8 needs a 3rd block for a: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and s.waiting[0] is b
    assert len(kv.block_ids("a")) == 3 and kv.block_ids("b") == []
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    hits = kv.prefix_hits
    out = fake_step(s)  # b comes back: 9 tokens (prompt + 2 generated), its first
    # full block still in the prefix cache, so 5 are recomputed
    assert out.scheduled[0].request is b and out.scheduled[0].num_new_tokens == 5
    assert kv.prefix_hits - hits == 4
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    kv.check_all_free()


def test_a_step_carries_the_host_tiers_copies_and_an_empty_one_leaves_them_queued():
    """The step object (SchedulerOutput) holds what the runner applies before the forward: the
    host tier's queued copies go with the first step that runs, never with an empty one."""
    from pdserve.engine.offload import HostIndex

    kv = KVCacheManager(16, 4, host=HostIndex(4))
    s = Scheduler(kv, 8, 32)
    kv.host.offload(5, bytes(32))  # a block evicted earlier: its copy to host slot 0 is queued
    empty = s.schedule()
    assert not empty and empty.tier_ops is None
    s.add(req("a", 6))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert out.tier_ops.offloads == [(5, 0)] and kv.host.take() is None
