"""pdserve.cluster: Ray actors for the prefill and decode pools, the block registry,
placement, pool management and the `pdserve` CLI. Ray is imported only when the
cluster itself is used, so `pdserve generate` runs without it."""

__all__ = ["Cluster", "ClusterSpec"]


def __getattr__(name: str):
    if name == "Cluster":
        from .cluster import Cluster

        return Cluster
    if name == "ClusterSpec":
        from .spec.cluster_spec import ClusterSpec

        return ClusterSpec
    raise AttributeError(f"module 'pdserve.cluster' has no attribute {name!r}")
