"""Running a scheduled step on a device: the model runner, attention metadata, graphs, the KV
tensor, weights loading and tensor parallelism."""
