"""The shards of a tensor-parallel engine (ranks 1..N-1) and how they are started.

A shard is a model runner without a scheduler: it joins rank 0's group, loads its slice
of the weights, allocates its slice of the KV cache (the same block count as rank 0:
the group agrees on the smallest) and then runs every step rank 0 sends it:

    run_shard(config, load_format, rank, address):  connect -> load -> loop:
        inputs = tp.recv()   (None: stop)
        runner.forward(inputs)

Who starts them: `LLMEngine` with `ProcessShards` (child processes: the offline `LLM`
and `pdserve generate`), or the cluster's worker actor with one Ray actor
per rank in the worker's placement group (cluster/workers/worker_actor.py). Either launcher
offers `dead()` (the ranks that are gone) and `close()`.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import subprocess
import sys
from abc import ABC, abstractmethod

import torch

from ..base.tp import TPError, TPGroup
from ..config import EngineConfig

log = logging.getLogger(__name__)


def shard_config(config: EngineConfig, rank: int, per_process_devices: bool) -> EngineConfig:
    """Rank `rank`'s copy of a resolved config: on CUDA, its own GPU (cuda:rank when one
    process sees all GPUs; the visible one when each sees its own)."""
    cfg = copy.copy(config)
    if per_process_devices and config.torch_device.type == "cuda":
        cfg.device = f"cuda:{rank}"
    return cfg


def run_shard(config: EngineConfig, load_format: str, rank: int, address: str, on_ready=None) -> None:
    """A shard's whole life; returns when rank 0 says stop, raises TPError if rank 0 died.
    `on_ready(runner)` runs once the weights and the KV cache are in place (the cluster's
    shard actor builds its transfer connector over `runner.kv` there)."""
    from .model_runner import ModelRunner
    from .runner_settings import RunnerSettings

    if config.torch_device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("PDSERVE_TORCH_THREADS", "1")))
    tp = TPGroup(rank, config.tensor_parallel_size).connect(config.torch_device, address,
                                                            custom_all_reduce=not config.disable_custom_all_reduce)
    runner = ModelRunner(RunnerSettings.of(config), load_format, tp)
    if on_ready is not None:
        on_ready(runner)
    while True:
        inputs = tp.recv()
        if inputs is None:
            runner.close()
            return
        runner.forward(inputs)


class Shards(ABC):
    """Ranks 1..N-1 of one engine, as its launcher started them."""

    @abstractmethod
    def dead(self) -> list[int]:
        """Ranks that are no longer running."""

    @abstractmethod
    def close(self) -> None:
        """Stops them (after rank 0 sent stop, or to kill them)."""


class ProcessShards(Shards):
    """One child process per rank on this host (`python -m pdserve.engine.exec.shard`, the
    config pickled on its stdin: no `if __name__ == "__main__"` needed in the caller's
    script, unlike multiprocessing's spawn)."""

    def __init__(self, config: EngineConfig, load_format: str, address: str):
        self.procs = []
        for rank in range(1, config.tensor_parallel_size):
            p = subprocess.Popen([sys.executable, "-m", "pdserve.engine.exec.shard"], stdin=subprocess.PIPE)
            p.stdin.write(pickle.dumps((shard_config(config, rank, True), load_format, rank, address)))
            p.stdin.close()
            self.procs.append(p)

    def dead(self) -> list[int]:
        return [i + 1 for i, p in enumerate(self.procs) if p.poll() is not None]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> None:
    config, load_format, rank, address = pickle.load(sys.stdin.buffer)
    try:
        run_shard(config, load_format, rank, address)
    except TPError as e:  # rank 0 is gone: nothing left to serve
        log.warning("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
