"""Validated configuration: what the user sets (EngineConfig, vLLM's engine-argument
names) and what the model directory says (ModelConfig, parsed from config.json)."""

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

# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: serve past the model's max_position_embeddings anyway
ALLOW_LONG = "PDSERVE_ALLOW_LONG_MAX_MODEL_LEN"

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
# int8 / fp8: 1-byte values with a float32 scale per token and head (ops/kv_quant.py)
# int4: two values a byte with a float16 scale per 32 (ops/kv_quant.py); its storage dtype
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


@dataclass(frozen=True)
class AttentionTuning:
    """How a CUDA step that is not all decodes runs attention (models/attention.AttentionPlan):
    `decodes_apart` sends its decode rows through the paged-decode kernel and the rest through
    paged-prefill, False runs every row through one paged-prefill launch, None decides by shape
    (apart from `apart_from_tokens` prefill tokens on); `prefill_tiles` picks the paged-prefill
    kernel's tile settings ("mixed" or "prefill"; None: by the step's rows). The defaults come
    from bench/mixed_step_gpu.py --variants (docs/design/graphs.md)."""

    decodes_apart: bool | None = None
    apart_from_tokens: int = 512
    prefill_tiles: str | None = None

    def __post_init__(self) -> None:
        if self.prefill_tiles not in (None, "mixed", "prefill"):
            raise ValueError(f"attention prefill_tiles must be 'mixed', 'prefill' or None, got {self.prefill_tiles!r}")


@dataclass
class EngineConfig:
    """Engine arguments; names follow vLLM's where vLLM has one."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's (or bf16) on GPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU default: 1 GiB
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # fcfs: arrival order | priority: SamplingParams.priority (lower first), then arrival; the
    # queue order and the preemption victim (the last of that order) follow it (core/scheduler.py)
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # auto (triton on CUDA) | torch | triton
    enforce_eager: bool = False  # no CUDA graphs
    # tensor parallel on CUDA: NCCL for every all-reduce, in place of the one-shot all-reduce over
    # CUDA IPC buffers that takes the small ones (engine/base/ipc_allreduce.py)
    disable_custom_all_reduce: bool = False
    # the host's work for step n+1 (scheduling, inputs, step n's outputs) while step n runs, the
    # sampled tokens feeding step n+1 on the device (engine/core/overlap.py); steps with requests that
    # need the host between steps (log-probs, grammars, penalties, speculation, TP) run in turn
    async_scheduling: bool = True
    # steps of up to this many tokens that are not all decodes replay piecewise CUDA graphs
    # (engine/exec/graphs.py); larger ones run eagerly
    cuda_graph_max_tokens: int = 512
    # Triton kernels for RMSNorm + residual, rope and SiLU * gate (engine/ops/triton_fused.py).
    # None (auto): on where Triton runs on CUDA (H200, Llama-3-8B shape: decode step 7.64 -> 5.76 ms
    # at batch 1, 4K prefill 136 -> 108 ms; bench/results/engine_gpu_b64_*.md); True needs Triton
    fused_ops: bool | None = None
    load_format: str = "auto"  # auto: the checkpoint's safetensors | dummy: random values (benchmarks)
    seed: int = 0
    # a time-per-output-token target in seconds: while requests decode, a step carries only the
    # prefill chunk that keeps it inside this (engine/core/step_model.py); None: the step budget only
    slo_tpot_s: float | None = None
    # prompt + output tokens of a decode batch's sequences: the KV room must hold max_num_seqs (exec/kv_cache.py)
    decode_batch_len: int | None = None
    # ranks (GPUs) one engine spans, Megatron-style (engine/base/tp.py); rank 0 schedules and samples
    tensor_parallel_size: int = 1
    # a mixture-of-experts model's experts whole, num_experts / N on each of the N ranks (expert
    # parallelism), instead of I / N rows of every expert (engine/models/moe.py)
    enable_expert_parallel: bool = False
    # the host-memory tier of the prefix cache, GiB per rank (engine/tiers/offload.py); 0: off
    kv_offloading_size: float = 0.0
    # the host tier written here on close (and every kv_persist_interval_s), read back on start
    kv_persist_dir: str | None = None
    kv_persist_interval_s: float = 60.0
    # the disk tier behind the host tier (engine/tiers/disk_tier.py): blocks the host tier drops are
    # written here, a prompt continuing on disk reads them back; GiB of files, one directory per node
    kv_disk_dir: str | None = None
    kv_disk_size: float = 0.0
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
    # "prompt_lookup_min": n} (spec/decode.py); None: off
    speculative_config: dict | None = None
    # eviction for long sessions (engine/base/kv_window.py): each request keeps its first kv_sink_tokens
    # (whole blocks) and kv_window_tokens more; None: off. kv_evict: which ones: "window", the last
    # (StreamingLLM); "h2o", the last half and the blocks that drew the most attention (heavy hitters)
    kv_sink_tokens: int = 0
    kv_window_tokens: int | None = None
    kv_evict: str = "window"
    # how mixed steps run attention on CUDA (benchmarks compare the variants through it)
    attention_tuning: AttentionTuning = field(default_factory=AttentionTuning)
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
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {bs}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.slo_tpot_s is not None and not (isinstance(self.slo_tpot_s, (int, float)) and self.slo_tpot_s > 0):
            raise ValueError(f"slo_tpot_s must be a number of seconds > 0, got {self.slo_tpot_s!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        self._check_tiers(tp)
        self.spec = SpeculativeConfig.from_dict(self.speculative_config)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(_KV_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":  # vLLM's alias: one name on the wire
            self.kv_cache_dtype = "fp8"
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        settle_window(self)

    def _check_tiers(self, tp: int) -> None:
        off = self.kv_offloading_size
        if isinstance(off, bool) or not isinstance(off, (int, float)) or off < 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {off!r}")
        if self.kv_persist_dir is not None and not off:
            raise ValueError("kv_persist_dir persists the host tier: set kv_offloading_size (GiB) too")
        if self.kv_persist_dir is not None and isinstance(tp, int) and tp > 1:
            raise ValueError("kv_persist_dir is not supported with tensor_parallel_size > 1 yet "
                             "(each rank holds a slice of the host tier)")
        if self.kv_disk_dir is not None:
            if not off:
                raise ValueError("kv_disk_dir sits behind the host tier: set kv_offloading_size (GiB) too")
            if isinstance(self.kv_disk_size, bool) or not isinstance(self.kv_disk_size, (int, float)) \
                    or self.kv_disk_size <= 0:
                raise ValueError(f"kv_disk_size must be a number of GiB > 0, got {self.kv_disk_size!r}")
            if self.kv_persist_dir is not None:
                raise ValueError("kv_disk_dir keeps the host tier across restarts itself: drop kv_persist_dir")
            if isinstance(tp, int) and tp > 1:
                raise ValueError("kv_disk_dir is not supported with tensor_parallel_size > 1 yet "
                                 "(each rank holds a slice of each block)")
        if not (isinstance(self.kv_persist_interval_s, (int, float)) and self.kv_persist_interval_s > 0):
            raise ValueError(f"kv_persist_interval_s must be > 0, got {self.kv_persist_interval_s!r}")

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
