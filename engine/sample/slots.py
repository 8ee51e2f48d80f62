"""Each live request's sampling parameters in one device table, a row (slot) per request.

    assign   the first time the sampler draws for a request: its row is written (one upload of
             seven numbers), and it keeps the slot while it lives (preempted, handed off or not)
    gather   a step's rows: one upload of the rows' slots (with what seeded rows need), then
             the parameters are read on the device
    release  the request finished (Sampler.forget): its slot is reused

A row holds temperature (1 for a greedy request), top_p, min_p, top_k (0: the whole vocabulary),
greedy, seeded and the seed's key (sampling_noise.seed_key) in float64, which holds each of them
exactly; the sampler casts the columns it reads to the dtypes the Python values had before
(float32 for temperature, top_p and min_p), so the draws are the same bits. The table doubles
when every slot is taken.
"""

from __future__ import annotations

import torch

from ..base.host_to_device import to_device
from ..sampling_params import SamplingParams
from .sampling_noise import seed_key

TEMPERATURE, TOP_P, MIN_P, TOP_K, GREEDY, SEEDED, SEED_KEY = range(7)


def row(p: SamplingParams) -> list[float]:
    """A request's row of the table."""
    seeded = p.seed is not None and not p.greedy
    vals = (1.0 if p.greedy else p.temperature, p.top_p, p.min_p, min(max(p.top_k, 0), 1 << 53), p.greedy, seeded,
            seed_key(p.seed) if seeded else 0)
    return [float(v) for v in vals]


class SamplingSlots:
    def __init__(self, device: torch.device, capacity: int = 64):
        self.device = device
        self.table = torch.zeros(capacity, 7, dtype=torch.float64, device=device)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._params: list[SamplingParams | None] = [None] * capacity  # what each slot's row was written from
        self.writes = 0  # rows uploaded (one per request assigned)

    def __len__(self) -> int:
        return len(self.slot_of)

    def slot(self, request_id: str, params: SamplingParams) -> int:
        """The request's slot, assigned and written the first time it is asked for (again when the
        id comes back with other parameters: a request that reuses a finished one's id)."""
        s = self.slot_of.get(request_id)
        if s is not None and self._params[s] is params:
            return s
        if s is None:
            if not self._free:
                n = self.table.shape[0]
                self.table = torch.cat([self.table, torch.zeros_like(self.table)])
                self._params += [None] * n
                self._free = list(range(2 * n - 1, n - 1, -1))
            s = self.slot_of[request_id] = self._free.pop()
        self._params[s] = params
        self.table[s].copy_(to_device(row(params), self.device, torch.float64), non_blocking=True)
        self.writes += 1
        return s

    def release(self, request_id: str) -> None:
        s = self.slot_of.pop(request_id, None)
        if s is not None:
            self._params[s] = None
            self._free.append(s)
