"""`pdserve profile`: one engine on one GPU (or the CPU) timed over the step shapes serving meets,
into a profile (profile.py) the simulator predicts a cluster from.

The engine is the real one (`LLMEngine`, the flags' engine arguments: model, dtype, TP, memory
share, step budget), run on requests of its own: for each prompt length L and batch B, B random
prompts of L tokens arrive one per step and each decodes `decode_tokens` tokens. That gives
prefill chunks at contexts 0..L (a prompt over the step budget is chunked), decode-only steps of
1..B rows at contexts L..L+decode_tokens, and the mixed steps between them. Every step is timed
as the engine's own step model times it (its wall time, scheduling and sampling included) and the
profile's coefficients are that model's fit over all of them. A (L, B) whose prompts would not fit
the KV cache, or pass `max_tokens_per_point` prompt tokens, is cut to what does.

The same-GPU handoff is measured (a device copy of 64 and 1024 KV blocks: fixed + per byte); the
links across GPUs of a host and across hosts are the committed measurements named in LINKS_MEASURED
unless given.
"""

from __future__ import annotations

import random
import time

import numpy as np

from pdserve.engine.core.scheduler import StepShape

from .profile import Link, Profile

# links a one-GPU machine cannot measure, from the committed runs that did
LINKS_MEASURED = {
    # 2x H200, disagg:1:1 served: send start to received 3.9 ms p50 for 512 MiB handoffs; the copy
    # engine moves 392 GB/s between the GPUs (bench/results/ipc/cross_gpu_copy.md, multi_gpu/README.md)
    "same_host": Link(0.0026, 392.0, "bench/results/ipc/cross_gpu_copy.md; multi_gpu/README.md (3.9 ms p50 served)"),
    # two hosts over TCP (gloo), 0.5-0.6 GB/s, ~20 ms at 22 MiB with staged copies
    # (bench/results/cross_host/staged_before/; sent in place since: 1.3-1.55 GB/s at 2K tokens on the same bed)
    "network": Link(0.005, 0.6, "bench/results/cross_host/staged_before/README.md (gloo over TCP)"),
}


def drive(engine, contexts: list[int], batches: list[int], decode_tokens: int, max_tokens_per_point: int,
          progress=None) -> list[tuple[StepShape, float]]:
    """Runs the grid on `engine`; every timed step as (shape, seconds)."""
    from pdserve.engine.sampling_params import SamplingParams

    model = engine.step_model
    model.record = samples = []
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    blocks = engine.kv.num_blocks
    bs = engine.config.block_size
    points = [(L, B) for L in contexts for B in batches if L < engine.config.max_model_len - decode_tokens]
    for n, (L, B) in enumerate(points):
        per = -(-(L + decode_tokens) // bs)
        B = max(1, min(B, engine.config.max_num_seqs, blocks // per - 1, max(1, max_tokens_per_point // L)))
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        todo = [[rng.randrange(10, vocab - 10) for _ in range(L)] for _ in range(B)]
        while todo or engine.has_unfinished_requests():
            if todo:
                engine.add_request(todo.pop(), params)
            engine.step()
        engine.kv.reset_prefix_cache()
        if progress is not None:
            progress(n + 1, len(points), f"L={L} B={B}: {len(samples)} steps")
    model.record = None
    return samples


def fit(samples: list[tuple[StepShape, float]], max_tokens: int, graphs: dict[int, float]) -> tuple[dict, float]:
    """The step model's coefficients over every sample, and its median relative error on them."""
    from pdserve.engine.core.step_model import StepModel

    model = StepModel(max_tokens, None, graphs=graphs, window=len(samples) + 1)
    for shape, seconds in samples:
        model.observe(shape, seconds)
    model.fit_all()
    err = [abs(model.predict(s.rows, s.prefill_tokens, s.kv_tokens, s.attn) - t) / t for s, t in samples if t > 0]
    return model.coefficients(), float(np.median(err)) if err else 0.0


def same_gpu_link(device) -> Link:
    """A device-to-device copy of 64 and of 1024 blocks' worth (2 MiB each, Llama-3-8B's bf16
    block): fixed + per byte, the median of 5 each."""
    import torch

    if device.type != "cuda":
        return Link(0.0005, 10.0, "CPU: a guess (no device copy)")

    def timed(nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        out = []
        for _ in range(6):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(device)
            out.append(time.perf_counter() - t0)
        return float(np.median(out[1:]))

    small, large = 64 * (2 << 20), 1024 * (2 << 20)
    ts, tl = timed(small), timed(large)
    gbps = (large - small) / max(tl - ts, 1e-9) / 1e9
    return Link(max(ts - small / (gbps * 1e9), 0.0) + 0.001, gbps,
                "measured: device copy (+1 ms: the pair's order and the IPC open, one-GPU runs' served p50 2-3 ms)")


def profile(engine, name: str, device_name: str, contexts: list[int], batches: list[int], decode_tokens: int,
            max_tokens_per_point: int, share: float, command: str = "", progress=None) -> Profile:
    """Profiles `engine` (built at gpu_memory_utilization `share`) into a Profile."""
    import torch

    samples = drive(engine, contexts, batches, decode_tokens, max_tokens_per_point, progress)
    coef, err = fit(samples, engine.config.max_num_batched_tokens, engine.step_model.graphs)
    layout = engine.runner.layout
    block_bytes = layout.block_bytes
    blocks = engine.kv.num_blocks
    device = engine.runner.device
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        fixed = int(share * total - blocks * block_bytes)
    else:  # a CPU engine's KV budget is its own: the profile holds what it held at `share`
        total, fixed = int(blocks * block_bytes / share), 0
    links = {"same_gpu": same_gpu_link(device), **LINKS_MEASURED}
    return Profile(name, device_name, engine.config.tensor_parallel_size, coef, total, fixed, block_bytes, share,
                   engine.config.max_num_seqs, engine.config.max_model_len, engine.config.block_size,
                   dict(engine.step_model.graphs), links, len(samples), err, command)
