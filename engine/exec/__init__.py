"""Running a scheduled step on a device.

    model_runner   the runner: a step's inputs, the forward, sampling; the host tier's copies
    step_inputs    `DecodeRows` and `FlatBatch` (a step's inputs) and the one builder of their ids, positions, slots
    step_result    `StepResult`, what a step gives back
    graphs         the step's one path decision, decode graphs and piecewise graphs
    kv_cache       the KV tensor: its size, allocation and per-layer views
    loader         a model's weights, by its family's targets
    shard          ranks 1..N-1 of a tensor-parallel engine and their launchers
"""
