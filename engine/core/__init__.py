"""Requests and what decides a step: the block pool, the KV-cache manager, the scheduler, the
overlapped step's bookkeeping and the step-cost model."""
