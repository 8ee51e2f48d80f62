"""Validated configuration: what the user sets (EngineConfig, the settings groups of settings.py
as vLLM's engine-argument names) and what the model directory says (ModelConfig, parsed from
config.json)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

from .architectures import KVCacheSpec, MLAConfig, MoEConfig, architecture_of
from .base.kv_window import KVWindow, settle_window
from .base.speculative import SpeculativeConfig
from .base.tp import check_tp
from .fp8 import WeightQuant, weight_quant_of
from .ops.kv_quant import check_head_dim
from .settings import (
    GROUPS,
    CacheSettings,
    KernelSettings,
    ModelSettings,
    ParallelSettings,
    SchedulerSettings,
    SpecSettings,
    TierSettings,
    WindowSettings,
)

# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: serve past the model's max_position_embeddings anyway
ALLOW_LONG = "PDSERVE_ALLOW_LONG_MAX_MODEL_LEN"

# settings.DTYPES and KV_DTYPES as torch dtypes (int4: its storage dtype, two values a byte)
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "int4": torch.uint8}
_FUSED_NEEDS_TRITON = ("fused_ops needs Triton: the triton attention backend (auto on CUDA, or "
                       "attention_backend='triton' with TRITON_INTERPRET=1 on CPU)")


@dataclass
class ModelConfig:
    """The parts of a config.json the engine needs, read through the architecture's rules
    (engine/architectures.py): the family that builds it, its shape, its MoE layers, and the KV
    cache it declares (`kv_cache_spec`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias
    # per layer: the attention window in tokens, None for full attention (HF's layer_types)
    layer_windows: tuple[int | None, ...]
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    o_bias: bool = False  # the output projection carries a bias (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama's mlp_bias)
    family: str = "llama"  # the engine/models/<family>.py that builds it
    qk_norm: bool = False  # an RMSNorm over each q and k head before rope (Qwen3)
    moe: MoEConfig | None = None  # sparse expert layers (Qwen3-MoE, Mixtral, DeepSeek)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3)
    weight_quant: WeightQuant | None = None  # an FP8 block-scaled checkpoint (engine/fp8.py)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """What each layer caches per token (every layer alike): K and V rows per KV head, or
        MLA's one latent row shared by all heads (held whole on every tensor-parallel rank)."""
        if self.mla is not None:
            return KVCacheSpec(1, self.mla.latent_dim, sharded=False, parts=1)
        return KVCacheSpec(self.num_kv_heads, self.head_dim)

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model path {path!r} has no config.json (not a Hugging Face model directory)")
        with open(cfg_path) as f:
            cfg = json.load(f)
        row = architecture_of(cfg, path)
        arch = row.name
        weight_quant = weight_quant_of(cfg.get("quantization_config"), path)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        mla = row.mla(cfg)
        # transformers >= 5 writes rope settings under rope_parameters
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            allowed = ("default", "llama3", "linear") + row.rope_types
            if rtype not in allowed:
                raise ValueError(f"rope scaling type {rtype!r} is not supported for {arch} ({', '.join(allowed[1:])})")
            if rtype == "default":
                scaling = None
        biases, windows = row.biases(cfg), row.windows(cfg)
        eos = cfg.get("eos_token_id")
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if mla else cfg.get("num_key_value_heads") or num_heads,
            head_dim=mla.qk_head_dim if mla else cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=biases[0],
            layer_windows=windows,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            o_bias=biases[1],
            mlp_bias=biases[2],
            family=row.module,
            qk_norm=row.qk_norm,
            moe=row.moe(cfg),
            mla=mla,
            weight_quant=weight_quant,
        )


@dataclass
class EngineConfig(SpecSettings, KernelSettings, SchedulerSettings, WindowSettings, TierSettings, CacheSettings,
                   ParallelSettings, ModelSettings):
    """Engine arguments: every settings group's fields (settings.py; vLLM's names where vLLM has
    one) as one flat keyword list, each group checked as it is built, then the checks that join
    two groups. `resolve` reads the model and the device once."""

    # resolved by resolve()
    model_config: ModelConfig | None = field(default=None, repr=False)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"model_config"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        for group in GROUPS:
            group._check(self)
        tp = self.tensor_parallel_size
        if tp > 1 and self.kv_persist_dir is not None:
            raise ValueError("kv_persist_dir is not supported with tensor_parallel_size > 1 yet "
                             "(each rank holds a slice of the host tier)")
        if tp > 1 and self.kv_disk_dir is not None:
            raise ValueError("kv_disk_dir is not supported with tensor_parallel_size > 1 yet "
                             "(each rank holds a slice of each block)")
        self.spec = SpeculativeConfig.from_dict(self.speculative_config)
        settle_window(self)

    # ---- resolution against the model and the device ---------------------------------
    def resolve(self, model_path: str) -> EngineConfig:
        """Against the model (`resolve_model`), then this process's device: the engine's call."""
        self.resolve_model(model_path)
        if self.fused_ops is None:
            self.fused_ops = self.use_triton and self.torch_device.type == "cuda"
        if self.fused_ops and not self.use_triton:
            raise ValueError(_FUSED_NEEDS_TRITON)
        mc = self.model_config
        if mc.mla is not None and self.kv_cache_dtype == "int4" and self.use_triton:
            raise ValueError("kv_cache_dtype='int4' on latent rows (MLA) runs in torch only (attention_backend="
                             "'torch'): the MLA kernels read bf16, int8 and fp8 rows (int8: 1.9x bf16's tokens)")
        return self

    def resolve_model(self, model_path: str) -> EngineConfig:
        """Reads the model's config.json and checks the settings against it, once: a spec
        resolved where the cluster starts crosses to its workers resolved, and they read the
        model's config again for nothing. Device-free: what depends on the GPU a process holds
        (fused_ops auto, the Triton kernels' limits) is `resolve`'s, in that process."""
        if self.model_config is not None and self.model == model_path:
            return self
        if self.fused_ops and self.attention_backend == "torch":
            raise ValueError(_FUSED_NEEDS_TRITON)
        self.model = model_path
        self.model_config = mc = ModelConfig.from_dir(model_path)
        check_tp(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, self.tensor_parallel_size)
        if self.enable_expert_parallel:
            mc = self.model_config = dataclasses.replace(mc, moe=expert_parallel(mc.moe, self.tensor_parallel_size))
        elif mc.moe is not None and mc.moe.intermediate_size % self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must divide the model's expert "
                             f"intermediate size {mc.moe.intermediate_size} (or enable_expert_parallel: experts "
                             "whole, split across the ranks)")
        if mc.mla is not None and self.kv_window_tokens is not None:
            raise ValueError("kv_window_tokens rotates each cached key head's rope part as the window moves; a "
                             "latent-attention (MLA) model caches one latent per token, its rope part inside it: "
                             "the window does not run on it (unset kv_window_tokens)")
        check_head_dim(self.kv_cache_dtype, mc.kv_cache_spec.head_dim, kernels=mc.mla is None)
        shared = mc.moe.shared_intermediate_size if mc.moe is not None else 0
        if shared % self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must divide the model's shared "
                             f"experts' intermediate size {shared}")
        if self.max_model_len is None:
            self.max_model_len = mc.max_position_embeddings
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if (n := self.decode_batch_len) is not None and not 1 <= n <= self.max_model_len:
            raise ValueError(f"decode_batch_len must be in [1, max_model_len {self.max_model_len}], got {n}")
        if self.max_model_len > mc.max_position_embeddings and os.environ.get(ALLOW_LONG) != "1":
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({mc.max_position_embeddings}): positions past it were never trained and the output "
                             f"degrades; set {ALLOW_LONG}=1 to allow it anyway")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (2048 if self.enable_chunked_prefill
                                           else max(self.max_model_len, 2048))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")
        if self.max_num_batched_tokens < self.max_num_seqs and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        window = KVWindow.of(self)
        if window and window.max_cache_tokens + self.max_num_batched_tokens > self.max_model_len:
            raise ValueError(f"kv_window_tokens {self.kv_window_tokens}: a request's cache positions reach "
                             f"{window.max_cache_tokens} (sinks, window, eviction chunk) + a step's "
                             f"{self.max_num_batched_tokens} tokens, past max_model_len {self.max_model_len}; "
                             "lower kv_window_tokens or max_num_batched_tokens")
        return self

    @property
    def torch_device(self) -> torch.device:
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                           if self.device == "auto" else self.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        ckpt = (self.model_config.torch_dtype if self.model_config else None) or "bfloat16"
        dt = _DTYPES.get(ckpt, torch.bfloat16)
        return torch.bfloat16 if dt == torch.float32 else dt

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else _KV_DTYPES[self.kv_cache_dtype]

    @property
    def use_triton(self) -> bool:
        if self.attention_backend == "torch":
            return False
        if self.attention_backend == "triton":
            return True
        return self.torch_device.type == "cuda"


def expert_parallel(moe: MoEConfig | None, size: int) -> MoEConfig:
    """The model's experts laid out whole across `size` ranks, or ValueError naming why not. One
    rank holds every expert either way (a TP=1 pool of a cluster whose other pool splits them)."""
    if moe is None:
        raise ValueError("enable_expert_parallel: the model has no experts (not a mixture-of-experts model)")
    if size < 2:
        return moe
    if moe.num_experts % size:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {size} must divide the model's "
                         f"{moe.num_experts} experts")
    return dataclasses.replace(moe, expert_parallel=True)
