"""Two engines on one device, measured: how much each one's steps slow while the other steps.

The one-GPU serving runs put two workers (two processes, 0.42 of the GPU's memory each) on one
GPU. Their steps do not take turns: the GPU time-slices between the two processes' kernels, and
one's host work (scheduling, sampling, launches) runs beside the other's kernels. `measure`
starts two engines of the same settings in two processes and times their steps alone and side by
side, for each pair of step kinds:

    decode   a batch of `batch` requests at `context` tokens, decoding (decode-only steps)
    prefill  full chunks of the step budget, prompts of `context` tokens fed as fast as they go

`Sharing.factors[(own, other)]` is the mean step of kind `own` while the other engine runs
steps of kind `other`, over its mean alone (each side's steps in a window both engines run
together). The mean, not the median: the GPU time-slices between the two processes, so steps
beside the other engine are uneven (most a little slower, some waiting out a whole slice of the
other's), and a request's TPOT is the mean of its steps. `Sharing.spread` keeps the median's and
the 90th percentile's ratios too, to show how uneven. The simulator (engine.SimGpu) runs the
engines of a shared GPU side by side, each step stretched by its factor for the time the other
steps; a profile without them (`sharing` None) takes whole steps in turn.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass, field

KINDS = ("decode", "prefill")


@dataclass(frozen=True)
class Sharing:
    """Per (own kind, other kind): a step's time beside the other engine over its time alone."""

    factors: dict[tuple[str, str], float]
    source: str = ""
    steps: dict[str, int] = field(default_factory=dict)  # "own|other" -> steps of `own` timed side by side
    # "own|other" -> {"median": .., "mean": .., "p90": ..}: that statistic beside over the same alone
    spread: dict[str, dict[str, float]] = field(default_factory=dict)

    def factor(self, own: str, other: str) -> float:
        return self.factors[(own, other)]

    def as_json(self) -> dict:
        return {"factors": {f"{a}|{b}": v for (a, b), v in self.factors.items()}, "source": self.source,
                "steps": dict(self.steps), "spread": {k: dict(v) for k, v in self.spread.items()}}

    @classmethod
    def from_json(cls, d: dict | None) -> Sharing | None:
        if not d:
            return None
        factors = {tuple(k.split("|")): float(v) for k, v in d["factors"].items()}
        return cls(factors, d.get("source", ""), dict(d.get("steps", {})),
                   {k: dict(v) for k, v in d.get("spread", {}).items()})


def _prime(engine, kind: str, context: int, batch: int, rng: random.Random) -> None:
    """Brings `engine` to where a window of `kind` steps starts: a decode batch past its prefill."""
    from pdserve.engine.sampling_params import SamplingParams

    if kind != "decode":
        return
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=engine.config.max_model_len - context - 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(10, vocab - 10) for _ in range(context)], params)
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def _window(engine, kind: str, context: int, start: float, seconds: float, rng: random.Random) -> list[float]:
    """From `start` (wall clock) for `seconds`: steps of `kind`; each timed step's seconds."""
    from pdserve.engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    budget = engine.config.max_num_batched_tokens
    model = engine.step_model
    while time.time() < start:
        time.sleep(0.001)
    model.record = samples = []
    while time.time() < start + seconds:
        if kind == "idle":
            time.sleep(0.01)
            continue
        if kind == "prefill":
            while len(engine.scheduler.waiting) * context < 2 * budget:
                engine.add_request([rng.randrange(10, vocab - 10) for _ in range(context)], one)
        engine.step()
    model.record = None
    want_prefill = kind == "prefill"
    return [s for shape, s in samples if bool(shape.prefill_tokens) == want_prefill and s > 0]


def _clear(engine) -> None:
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.reset_prefix_cache()


def _tenant(engine_args: dict, conn, seed: int) -> None:
    """One engine's process: builds it, says "ready", then answers each command: ("prime", kind,
    context, batch) -> "primed"; ("window", kind, context, start, seconds) -> its steps' seconds
    (then clears the engine). None ends it."""
    from pdserve import LLM

    rng = random.Random(seed)
    with LLM(**engine_args) as llm:
        engine = llm.engine
        conn.send("ready")
        while (cmd := conn.recv()) is not None:
            if cmd[0] == "prime":
                _prime(engine, *cmd[1:], rng)
                conn.send("primed")
            else:
                conn.send(_window(engine, *cmd[1:], rng))
                _clear(engine)


def _side_by_side(pipes, kinds: tuple[str, str], context: int, batch: int, seconds: float):
    """Primes both tenants for `kinds`, then one window of `seconds` from one start on both: each
    one's steps' seconds."""
    for conn, kind in zip(pipes, kinds):
        conn.send(("prime", kind, context, batch))
    for conn in pipes:
        conn.recv()
    start = time.time() + 0.5
    for conn, kind in zip(pipes, kinds):
        conn.send(("window", kind, context, start, seconds))
    return tuple(conn.recv() for conn in pipes)


PAIRS = (("decode", "idle"), ("prefill", "idle"), ("decode", "prefill"), ("decode", "decode"),
         ("prefill", "prefill"))


def measure(engine_args: dict, context: int = 2048, batch: int = 32, seconds: float = 8.0,
            source: str = "", progress=None) -> Sharing:
    """Two engines of `engine_args` in two processes (started one after the other, as each sizes
    its KV cache from what the device has free), timed alone and side by side for each of PAIRS:
    five windows of `seconds`."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    times: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    try:
        for seed in (0, 1):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_tenant, args=(engine_args, theirs, seed), daemon=True)
            p.start()
            procs.append(p)
            theirs.close()  # the child's end: a child that dies ends our recv (EOFError), not hangs it
            try:
                ready = mine.recv()
            except EOFError:
                ready = None
            if ready != "ready":
                raise RuntimeError(f"sharing tenant {seed} did not start (exit code {p.exitcode})")
            pipes.append(mine)
        for n, kinds in enumerate(PAIRS):
            times[kinds] = _side_by_side(pipes, kinds, context, batch, seconds)
            if progress is not None:
                progress(n + 1, len(PAIRS), "+".join(kinds))
    finally:
        for conn in pipes:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return _factors(times, source)


def _stats(t: list[float]) -> dict[str, float]:
    s = sorted(t)
    return {"median": statistics.median(s), "mean": statistics.fmean(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))]}


def _factors(times: dict[tuple[str, str], tuple[list[float], list[float]]], source: str) -> Sharing:
    """Each (own, other)'s factor: the mean step beside over the mean alone; its spread: the median,
    mean and 90th percentile beside, each over the same statistic alone."""
    alone = {kind: _stats(times[(kind, "idle")][0]) for kind in KINDS}
    factors, steps, spread = {}, {}, {}
    for (a, b), (ta, tb) in times.items():
        if b == "idle":
            continue
        sides = [(a, b, ta + tb)] if a == b else [(a, b, ta), (b, a, tb)]
        for own, other, t in sides:
            if t:
                beside = _stats(t)
                ratio = {k: round(v / alone[own][k], 3) for k, v in beside.items()}
                factors[(own, other)] = ratio["mean"]
                steps[f"{own}|{other}"] = len(t)
                spread[f"{own}|{other}"] = ratio
    return Sharing(factors, source, steps, spread)
