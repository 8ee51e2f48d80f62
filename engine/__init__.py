"""pdserve.engine: the paged-KV inference engine that prefill and decode roles share.

Nothing here imports Ray, FastAPI or the other pdserve packages. The names below load on first
use: `SamplingParams` (and the cluster's records, the block registry) need no torch, and a
process that starts only those (the registry's actor, the CLI before it parses its flags)
starts in a fraction of the time.
"""

__all__ = ["EngineConfig", "ModelConfig", "Request", "RequestStatus", "SamplingParams"]


def __getattr__(name: str):
    if name in ("EngineConfig", "ModelConfig"):
        from . import config

        return getattr(config, name)
    if name in ("Request", "RequestStatus"):
        from .core import request

        return getattr(request, name)
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
