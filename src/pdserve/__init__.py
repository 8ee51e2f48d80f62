"""pdserve: disaggregated prefill/decode LLM serving on Ray.

    from pdserve import LLM, SamplingParams
    outs = LLM().generate(["Hello"], SamplingParams(max_tokens=16))
"""

from pdserve.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
