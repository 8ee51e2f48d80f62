"""A profile: what one worker of one model shape on one GPU (at one TP size) costs, measured once,
from which the simulator (cluster.py) predicts a whole cluster.

    steps       the engine's own step-cost model (engine/core/step_model.py), fitted over every
                step a profiling run timed: seconds ~ base + mixed + per_seq x rows + per_token x
                prefill tokens + per_kv_token x decode context + per_attn x prefill tokens x their
                context (+ the decode graphs' start-up). The simulator's engines ask the same
                model for their TPOT-bounded chunks as a live engine does.
    memory      the GPU's bytes, what the engine kept for weights and activations at the profiled
                memory share, and one KV block's bytes: the blocks a worker holds at any share
    handoff     per link (same_gpu, same_host, network): a KV handoff's fixed seconds and its
                bandwidth, measured (same_gpu) or given with their source
    engine      the profiled engine's max_num_seqs, max_model_len, block size
    sharing     two engines of this shape on one GPU: each step kind's slowdown beside the other's
                (sharing.py, measured; absent: the simulator runs their steps in turn)

A profile is JSON (`save`, `load`); `pdserve profile` writes one (profiler.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pdserve.engine.core.step_model import FEATURES, StepModel

from .sharing import Sharing

LINKS = ("same_gpu", "same_host", "network")


@dataclass(frozen=True)
class Link:
    """A KV handoff over one kind of link: fixed_s + bytes / (gbps x 1e9)."""

    fixed_s: float
    gbps: float
    source: str = ""

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / (self.gbps * 1e9)


@dataclass
class Profile:
    model: str  # the shape's name (or the model directory's) as the serving runs name it
    device: str  # e.g. "one H200"
    tp: int
    coefficients: dict[str, float]  # step_model.FEATURES -> seconds per unit
    gpu_memory_bytes: int
    fixed_bytes: int  # weights, activations and the runtime's own: what the KV cache cannot use
    block_bytes: int  # one KV block (16 tokens) on one rank
    profiled_share: float  # the gpu_memory_utilization the engine was profiled at
    max_num_seqs: int
    max_model_len: int
    block_size: int = 16
    graphs: dict[int, float] = field(default_factory=dict)
    handoff: dict[str, Link] = field(default_factory=dict)
    samples: int = 0  # steps the fit saw
    fit_error: float = 0.0  # median |predicted - measured| / measured over them
    command: str = ""
    sharing: Sharing | None = None  # two engines on one GPU, measured (sharing.py); None: in turn

    def num_blocks(self, share: float) -> int:
        """The KV blocks one worker holds at `share` of the GPU's memory."""
        return max(0, int((share * self.gpu_memory_bytes - self.fixed_bytes) // self.block_bytes))

    def step_model(self, max_tokens: int, slo_tpot_s: float | None) -> StepModel:
        """A step model answering from this profile (it learns nothing more)."""
        model = StepModel(max_tokens, slo_tpot_s, graphs=self.graphs)
        model.set_coefficients(self.coefficients)
        return model

    def link(self, name: str) -> Link:
        if name not in self.handoff:
            raise ValueError(f"profile {self.model} has no '{name}' link (has: {', '.join(self.handoff) or 'none'})")
        return self.handoff[name]

    def save(self, path: str) -> None:
        data = asdict(self)
        data["graphs"] = {str(k): v for k, v in self.graphs.items()}
        data["sharing"] = self.sharing.as_json() if self.sharing is not None else None
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as f:
            data = json.load(f)
        missing = [k for k in FEATURES if k not in data.get("coefficients", {})]
        if missing:
            raise ValueError(f"{path}: not a profile (coefficients lack {', '.join(missing)})")
        data["graphs"] = {int(k): v for k, v in data.get("graphs", {}).items()}
        data["handoff"] = {k: Link(**v) for k, v in data.get("handoff", {}).items()}
        data["sharing"] = Sharing.from_json(data.get("sharing"))
        return cls(**data)
