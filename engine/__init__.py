"""pdserve.engine: the paged-KV inference engine that prefill and decode roles share.

Nothing here imports Ray, FastAPI or the other pdserve packages.
"""

from .config import EngineConfig, ModelConfig
from .core.request import Request, RequestStatus
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "ModelConfig", "Request", "RequestStatus", "SamplingParams"]
