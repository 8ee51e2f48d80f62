"""Speculative decoding's settings (vLLM's `speculative_config`): a leaf module, so the engine's
configuration reads it without importing the machinery (decode.py)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# no drafts while more decodes than this run (vLLM's speculative_disable_by_batch_size): the largest
# batch measured (bench/results/spec/)
DISABLE_BY_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: a Hugging Face directory with the target's vocabulary
    draft_kv_cache_memory_bytes: int = 1 << 30  # the draft model's own KV cache (draft.py)

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(d).__name__}")
        method = d.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {list(METHODS)}, got {method!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size", "model", "draft_kv_cache_memory_bytes"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        cfg = cls(**d)
        if method == "draft_model" and not isinstance(cfg.model, str):
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft's directory")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                     "draft_kv_cache_memory_bytes"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min {cfg.prompt_lookup_min} > "
                             f"prompt_lookup_max {cfg.prompt_lookup_max}")
        return cfg
