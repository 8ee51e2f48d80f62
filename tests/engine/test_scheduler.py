"""Scheduler on CPU with integer block ids only: token budget, chunked prefill,
max_num_seqs, preemption by recompute."""

from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.sampling_params import SamplingParams


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True, policy="fcfs"):
    kv = KVCacheManager(num_blocks, 4)
    return kv, Scheduler(kv, max_seqs, budget, chunked, policy)


def req(rid, n, base=0, priority=0):
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=8, priority=priority), max_tokens=8)


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
    from pdserve.engine.tiers.offload import HostIndex

    kv = KVCacheManager(16, 4, host=HostIndex(4))
    s = Scheduler(kv, 8, 32)
    kv.host.store(bytes(32), 5)  # a block evicted earlier: its copy to host slot 0 is queued
    empty = s.schedule()
    assert not empty and empty.tier_ops is None
    s.add(req("a", 6))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert out.tier_ops.offloads == [(5, 0)] and kv.host.take() is None


def test_priority_orders_admission_and_fcfs_keeps_arrival_order():
    for policy, want in (("fcfs", ["low", "mid"]), ("priority", ["high", "mid"])):
        kv, s = make(max_seqs=2, policy=policy)
        for rid, p in (("low", 5), ("mid", 1), ("high", -2)):
            s.add(req(rid, 3, base=10 * p + 50, priority=p))
        out = fake_step(s)
        assert [x.request.request_id for x in out.scheduled] == want, policy


def test_priority_preempts_the_lowest_priority_latest_arrival_and_a_high_arrival_takes_its_blocks():
    """4 blocks of 4 slots. Running: a (priority 1), b (priority 3), c (priority 1, after a).
    A priority-0 arrival that finds no blocks preempts b (the lowest priority), not c (the
    latest); under fcfs it waits."""
    for policy in ("fcfs", "priority"):
        kv, s = make(num_blocks=4, budget=64, policy=policy)
        a, b, c = req("a", 3, priority=1), req("b", 3, base=100, priority=3), req("c", 3, base=200, priority=1)
        for r in (a, b, c):
            s.add(r)
        fake_step(s)  # a, b, c hold a block each
        assert [r.request_id for r in s.running] == (["a", "b", "c"] if policy == "fcfs" else ["a", "c", "b"])
        hi = req("hi", 6, base=300, priority=0)  # needs 2 blocks, 1 is free
        s.add(hi)
        out = fake_step(s)
        if policy == "fcfs":
            assert out.preempted == [] and s.waiting[0] is hi
            assert [x.request.request_id for x in out.scheduled] == ["a", "b", "c"]
            continue
        assert [r.request_id for r in out.preempted] == ["b"] and b.status == RequestStatus.PREEMPTED
        assert [x.request.request_id for x in out.scheduled] == ["a", "c", "hi"]  # b's row left the step
        assert kv.block_ids("b") == [] and len(kv.block_ids("hi")) == 2
        assert [r.request_id for r in s.running] == ["hi", "a", "c"] and list(s.waiting) == [b]
        for r in (a, c, hi):
            s.finish(r, RequestStatus.FINISHED_STOPPED)
        out = fake_step(s)
        assert [x.request.request_id for x in out.scheduled] == ["b"]
        s.finish(b, RequestStatus.FINISHED_STOPPED)
        kv.check_all_free()


def test_priority_never_preempts_for_an_equal_or_lower_priority_arrival():
    kv, s = make(num_blocks=2, budget=64, policy="priority")
    a = req("a", 7, priority=0)
    s.add(a)
    fake_step(s)  # a holds both blocks
    late = req("late", 3, base=100, priority=0)
    s.add(late)
    out = fake_step(s)
    assert out.preempted == [] and s.waiting[0] is late and a.status == RequestStatus.RUNNING


def test_an_unknown_scheduling_policy_is_refused():
    import pytest

    from pdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority, got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")


def test_a_decode_steps_block_table_is_shared_until_a_block_is_added():
    """A decoding request's block table is one list for as long as its blocks stay the same (a
    step costs no copy of the whole context), a new list when a step adds a block; a step's table
    never changes after it was handed out."""
    kv, s = make(budget=32)
    a = Request("a", list(range(6)), SamplingParams(max_tokens=8), max_tokens=8)
    s.add(a)
    tables = [fake_step(s).scheduled[0].block_ids for _ in range(5)]  # 6 prompt tokens, then decodes
    snapshot = [list(t) for t in tables]
    assert [len(t) for t in tables] == [2, 2, 2, 3, 3]  # tokens 1-6, 7, 8 (block 2 full), 9, 10
    assert tables[1] is tables[2] and tables[3] is tables[4] and tables[2] is not tables[3]
    assert tables[3][:2] == tables[2] and [list(t) for t in tables] == snapshot
    assert tables[-1] == [b.block_id for b in kv.req_blocks["a"]] == kv.block_ids("a")
