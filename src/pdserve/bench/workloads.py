"""Benchmark workloads: each is a list of `BenchRequest` (token-id prompt, output length,
optional arrival time). Prompts are token ids, so any OpenAI-compatible endpoint sees
exactly the lengths and the prefix sharing asked for.

- trace: the Mooncake conversation trace. Every `hash_ids` entry stands for one block
  of 512 tokens; the same id always becomes the same tokens (seeded by the id and a
  salt), so shared prefixes in the trace are real shared prefixes. `length_scale`
  shrinks blocks and outputs (sharing structure kept); arrivals are the trace's
  timestamps divided by `time_scale`. The published trace records time in 3-second
  ticks (1,180 distinct timestamps for 12,031 requests, up to 28 per tick), so by
  default the requests of one tick are spread uniformly over it (`spread_ties`);
  `spread=False` replays each tick's requests at the same instant.
- synthetic: fixed input and output lengths, random distinct prompts.
- shared-prefix: `num_prefixes` system prompts of `system_len` tokens, each request one
  of them plus a distinct `question_len`-token question.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
# the Mooncake conversation trace, shipped with the package (origin and licence: data/NOTICE.md)
DEFAULT_TRACE = str(pathlib.Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl")


@dataclass
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    arrival: float | None = None  # seconds from start (trace replay); None: set by the arrival process


def _tokens(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    """`[rng.randrange(lo, hi) for _ in range(n)]`, the same values and the same draws of `rng`,
    about 5x faster (the capacity simulator makes a run's prompts on every rate it probes):
    randrange takes one 32-bit word of the generator per try (its top bits, k = the width's bit
    length) until one is below the width; the words are drawn here in bulk, as many as are still
    needed, so no word is drawn that randrange would not have drawn."""
    import numpy as np

    width = hi - lo
    k = width.bit_length()
    if width <= 0 or k > 32:
        return [rng.randrange(lo, hi) for _ in range(n)]
    out: list[int] = []
    while len(out) < n:
        m = n - len(out)  # each value takes at least one word: none drawn here is spare
        words = np.frombuffer(rng.getrandbits(32 * m).to_bytes(4 * m, "little"), dtype="<u4") >> (32 - k)
        out.extend((words[words < width] + lo).tolist())
    return out


def trace_workload(path: str, num_requests: int | None = None, length_scale: float = 1.0,
                   output_scale: float | None = None, time_scale: float = 1.0, max_input_len: int | None = None,
                   max_output_len: int | None = None, token_range: tuple[int, int] = (100, 30000), salt: int = 0,
                   start: int = 0, spread: bool = True) -> list[BenchRequest]:
    """The trace's requests [start, start + num_requests), scaled. Inputs are cut at
    `max_input_len` (keeping the prefix, so sharing survives); outputs at least 1 token. More
    requests than the trace holds from `start` go round it again, lap after lap: each lap's
    arrivals follow the last's by its span and one recorded tick, its hash ids are fresh tokens
    (a salt per lap: its prefixes shared within it, as the trace shares them, not with the lap
    before), so a 64-GPU cluster's probe is as long as a 16-GPU one's, not a fourth of it."""
    if length_scale <= 0 or time_scale <= 0:
        raise ValueError("length_scale and time_scale must be > 0")
    output_scale = length_scale if output_scale is None else output_scale
    block = max(1, round(TRACE_BLOCK * length_scale))
    lo, hi = token_range
    recs: list[dict] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= start:
                recs.append(json.loads(line))
            if num_requests is not None and len(recs) >= num_requests:
                break
    if not recs:
        raise ValueError(f"{path}: no requests read (start={start}, num_requests={num_requests})")
    stamps = sorted({r["timestamp"] for r in recs})
    tick = min((b - a for a, b in zip(stamps, stamps[1:])), default=1000)
    lap_ms = stamps[-1] - stamps[0] + tick
    cache: dict[tuple[int, int], list[int]] = {}
    out: list[BenchRequest] = []
    for n in range(len(recs) if num_requests is None else num_requests):
        lap, j = divmod(n, len(recs))
        rec, key = recs[j], (f"{salt}" if lap == 0 else f"{salt}:{lap}")
        n_in = max(1, round(rec["input_length"] * length_scale))
        if max_input_len:
            n_in = min(n_in, max_input_len)
        ids: list[int] = []
        for h in rec["hash_ids"]:
            if len(ids) >= n_in:
                break
            if (lap, h) not in cache:
                cache[lap, h] = _tokens(random.Random(f"{key}:{h}"), block, lo, hi)
            ids.extend(cache[lap, h])
        if len(ids) < n_in:  # the trace's last block may be longer than its hash ids cover
            ids.extend(_tokens(random.Random(f"{key}:tail:{start + j}"), n_in - len(ids), lo, hi))
        n_out = max(1, round(rec["output_length"] * output_scale))
        if max_output_len:
            n_out = min(n_out, max_output_len)
        at = rec["timestamp"] - stamps[0] + lap * lap_ms
        out.append(BenchRequest(ids[:n_in], n_out, at / 1000.0 / time_scale))
    if spread:
        for r, t in zip(out, spread_ties([r.arrival for r in out], random.Random(f"spread:{salt}"))):
            r.arrival = t
    return out


def spread_ties(times: list[float], rng: random.Random) -> list[float]:
    """Timestamps recorded at a coarse resolution: the k requests that share a timestamp
    t arrived somewhere in [t, next recorded timestamp); each gets a uniform random time
    there (the last group spreads over the median gap). Input order is kept per request;
    distinct timestamps are unchanged."""
    distinct = sorted(set(times))
    gaps = sorted(b - a for a, b in zip(distinct, distinct[1:]))
    median_gap = gaps[len(gaps) // 2] if gaps else 0.0
    nxt = {a: b for a, b in zip(distinct, distinct[1:])}
    count: dict[float, int] = {}
    for t in times:
        count[t] = count.get(t, 0) + 1
    return [t + rng.uniform(0.0, nxt.get(t, t + median_gap) - t) if count[t] > 1 else t for t in times]


def synthetic_workload(num_requests: int, input_len: int, output_len: int,
                       token_range: tuple[int, int] = (100, 30000), salt: int = 0) -> list[BenchRequest]:
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_requests, input_len and output_len must be >= 1")
    rng = random.Random(f"synthetic:{salt}")
    return [BenchRequest(_tokens(rng, input_len, *token_range), output_len) for _ in range(num_requests)]


def shared_prefix_workload(num_requests: int, system_len: int, question_len: int, output_len: int,
                           num_prefixes: int = 4, token_range: tuple[int, int] = (100, 30000),
                           salt: int = 0) -> list[BenchRequest]:
    if min(num_requests, system_len, question_len, output_len, num_prefixes) < 1:
        raise ValueError("num_requests, system_len, question_len, output_len, num_prefixes must be >= 1")
    rng = random.Random(f"shared:{salt}")
    systems = [_tokens(rng, system_len, *token_range) for _ in range(num_prefixes)]
    return [BenchRequest(systems[i % num_prefixes] + _tokens(rng, question_len, *token_range), output_len)
            for i in range(num_requests)]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Open-loop arrival times (seconds) with exponential gaps; rate=inf: all at once."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(f"poisson:{seed}:{rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
