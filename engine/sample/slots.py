"""Each live request's sampling parameters in device tables, a row (slot) per request.

    assign   the first time the sampler draws for a request: its row is written (one upload),
             and it keeps the slot while it lives (preempted, handed off or not)
    gather   a step's rows: one upload of the rows' slots (with what seeded rows need: their
             keys for this step's index), then three gathers on the device
    release  the request finished (Sampler.forget): its slot is reused

The tables: `floats` float32 [slots, 3] (temperature, 1 for a greedy request; top_p; min_p: the
float32 values the sampler has always used), `top_k` int64 (ALL: the whole vocabulary) and
`greedy` bool. They double when every slot is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.host_to_device import to_device
from ..sampling_params import SamplingParams

TEMPERATURE, TOP_P, MIN_P = range(3)
ALL = 1 << 62  # top_k of a request that keeps the whole vocabulary (any rank is below it)


def row(p: SamplingParams) -> tuple[list[float], int, bool]:
    """A request's row: its floats, its top_k, whether it is greedy."""
    k = p.top_k if p.top_k > 0 else ALL
    return [1.0 if p.greedy else float(p.temperature), float(p.top_p), float(p.min_p)], min(k, ALL), bool(p.greedy)


@dataclass
class Rows:
    """A step's rows' parameters, on the device."""
    floats: torch.Tensor  # float32 [n, 3]: temperature, top_p, min_p
    top_k: torch.Tensor  # int64 [n]
    greedy: torch.Tensor  # bool [n]

    @property
    def temperature(self) -> torch.Tensor:
        return self.floats[:, TEMPERATURE]

    @property
    def top_p(self) -> torch.Tensor:
        return self.floats[:, TOP_P]

    @property
    def min_p(self) -> torch.Tensor:
        return self.floats[:, MIN_P]


class SamplingSlots:
    def __init__(self, device: torch.device, capacity: int = 64):
        self.device = device
        self.floats = torch.ones(capacity, 3, dtype=torch.float32, device=device)
        self.top_k = torch.full((capacity,), ALL, dtype=torch.int64, device=device)
        self.greedy = torch.zeros(capacity, dtype=torch.bool, device=device)
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
                self._grow()
            s = self.slot_of[request_id] = self._free.pop()
        self._params[s] = params
        floats, k, greedy = row(params)
        vals = to_device(floats + [float(greedy)], self.device, torch.float32)
        self.floats[s] = vals[:3]
        self.greedy[s] = vals[3] > 0
        self.top_k[s] = k
        self.writes += 1
        return s

    def _grow(self) -> None:
        n = self.floats.shape[0]
        self.floats = torch.cat([self.floats, torch.ones_like(self.floats)])
        self.top_k = torch.cat([self.top_k, torch.full_like(self.top_k, ALL)])
        self.greedy = torch.cat([self.greedy, torch.zeros_like(self.greedy)])
        self._params += [None] * n
        self._free = list(range(2 * n - 1, n - 1, -1))

    def rows(self, slots: torch.Tensor) -> Rows:
        """The rows of `slots` (int64, on the device)."""
        return Rows(self.floats[slots], self.top_k[slots], self.greedy[slots])

    def repeat(self, slot: int, n: int) -> Rows:
        """One slot's row, n times (a request's verification rows)."""
        return Rows(self.floats[slot].expand(n, -1), self.top_k[slot].expand(n), self.greedy[slot].expand(n))

    def release(self, request_id: str) -> None:
        s = self.slot_of.pop(request_id, None)
        if s is not None:
            self._params[s] = None
            self._free.append(s)
