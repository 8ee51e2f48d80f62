"""What a cluster is, parsed once: `ClusterSpec` (cluster_spec.py), the pools' `ServingConfig`
(serving_config.py) and each pool's engine spec (`EngineSpecs`, engine_specs.py)."""
