"""Requests and what decides a step.

    request           `Request`, its status and outputs
    block_pool        KV blocks: free list, reference counts, the prefix cache's hash map
    kv_cache_manager  a request's blocks: prefix hits (host tier included), allocation, frees
    scheduler         which requests run a step, chunked prefill, preemption
    overlap           the overlapped (async) step's bookkeeping
    step_model        the step-cost model: a step's time from its shape, the TPOT-bounded chunk
    iteration_stats   per-step counters for metrics
"""
