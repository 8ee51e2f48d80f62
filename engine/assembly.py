"""The engine's parts, built once, in the order they depend on each other (`assemble`).

    tokenizer      the model's (ModelTokenizer)
    draft          a draft model's weights and KV (speculation with a draft model): before the
                   target's runner, whose KV budget then counts them (GPU)
    tp, shards     a tensor-parallel engine's ranks 1..N-1 and their groups
    grammars       structured outputs' matchers (over the tokenizer and the vocabulary)
    runner         weights, the KV tensor, CUDA graphs, the sampler (its RunnerSettings, the grammars)
    kv             the block manager over the runner's blocks (and the host tier's index)
    scheduler      the batch under its settings (SchedulerSettings alone) and the KV window
    step_model     the one step-time model (the same settings, the runner's graph times);
                   fitted here on CUDA before the first request
    drafter        proposals and verdicts; its off-switch asks the step model
    tier_file,     the host tier's persisted files or its disk tier (their TierSettings and what
    tiers          the blocks mean: the model's fingerprint, the runner's layout), and the tiers
                   below the GPU in lookup order

Each part is handed what it reads when it is built: no part is wired to another after its
construction. `LLMEngine` (engine.py) takes the parts as they come; prefill and decode roles add
their settings to the engine, not to the parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .base.kv_window import KVWindow
from .base.tp import TPGroup
from .config import EngineConfig
from .core.kv_cache_manager import KVCacheManager
from .core.scheduler import Scheduler
from .core.step_model import StepModel
from .exec.model_runner import ModelRunner
from .exec.runner_settings import RunnerSettings
from .exec.shard import ProcessShards, Shards
from .sample.structured import Grammars
from .settings import SchedulerSettings, TierSettings
from .spec.decode import Drafter, load_draft
from .spec.switch import SpecSwitch
from .stats import StartupTimes
from .tiers import persist
from .tiers.disk_tier import DiskTier
from .tiers.offload import HostIndex
from .tiers.tier import Tiers
from .tokenizer import ModelTokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What `assemble` built for one engine (rank 0), each part already given the parts it uses."""

    tokenizer: ModelTokenizer
    tp: TPGroup
    shards: Shards | None
    grammars: Grammars
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    step_model: StepModel
    drafter: Drafter
    tier_file: persist.HostTierFile | None
    tiers: Tiers


def calibrate(step_model: StepModel, runner: ModelRunner) -> None:
    """The step model fitted from the runner's timed calibration steps (before serving, on CUDA)."""
    try:
        step_model.calibrate(runner.calibration())
    except Exception as e:  # noqa: BLE001 - the model then learns from the first steps, as before
        log.warning("step model calibration skipped: %s", e)


def assemble(config: EngineConfig, load_format: str, launch_shards=None) -> EngineParts:
    """The parts of an engine serving `config` (resolved), in one pass (the module's order).
    `launch_shards(config, load_format, address) -> Shards` starts ranks 1..N-1 of a
    tensor-parallel engine (default: local processes, shard.ProcessShards)."""
    tokenizer = ModelTokenizer(config.tokenizer or config.model)
    draft = load_draft(config.spec, config)
    tp, shards, startup, t0 = TPGroup(), None, StartupTimes(), time.perf_counter()
    if config.tensor_parallel_size > 1:  # its ranks' start and groups: the worker's start says how long
        tp = TPGroup.serve(config.tensor_parallel_size)
        shards = (launch_shards or ProcessShards)(config, load_format, tp.address)
        tp.connect(config.torch_device, custom_all_reduce=not config.disable_custom_all_reduce)
        startup.tensor_parallel_s = time.perf_counter() - t0
    grammars = Grammars(lambda: tokenizer.hf, config.model_config.vocab_size)
    runner = ModelRunner(RunnerSettings.of(config), load_format, tp, grammars=grammars, startup=startup)
    host = HostIndex(runner.num_host_slots) if config.kv_offloading_size else None
    kv = KVCacheManager(runner.num_blocks, config.block_size, config.enable_prefix_caching, host=host)
    batch = SchedulerSettings.of(config)
    scheduler = Scheduler.of(kv, batch, KVWindow.of(config))
    # the one step-time model: the TPOT chunk, the advertised prefill rate, speculation's off-switch
    step_model = StepModel.of(batch, graphs=runner.graph_seconds)
    if runner.device.type == "cuda":  # fitted before the first request (CPU: LLMEngine.calibrate on demand)
        calibrate(step_model, runner)
    drafter = Drafter(config.spec, config.max_model_len, draft, SpecSwitch(step_model))
    # the host tier's files (tiers/persist.py, restored now), or its disk tier (tiers/disk_tier.py)
    tier_settings = TierSettings.of(config)
    on_disk = host is not None and (config.kv_persist_dir or config.kv_disk_dir)  # the model's files read only then
    meaning = persist.block_meaning(config.model, load_format, config.seed, runner.layout) if on_disk else None
    tier_file = persist.HostTierFile(tier_settings, meaning, host, runner.host) if config.kv_persist_dir else None
    disk = DiskTier.of(tier_settings, meaning, host, runner.host, step_model, kv)
    tiers = Tiers(kv, [t for t in (host, disk) if t is not None])  # below the GPU, in lookup order
    return EngineParts(tokenizer, tp, shards, grammars, runner, kv, scheduler, step_model, drafter, tier_file, tiers)
