"""Host-to-device copies that never wait for the GPU.

A copy from pageable host memory may first synchronize with the stream (CUDA's "API
synchronization behavior"; `torch.tensor(list, device="cuda")` is a synchronous copy that
does), so a step's input built while the previous step runs would wait for it: the overlapped
step (core/overlap.py) would overlap nothing. Every host array a step sends to the GPU goes through
pinned memory instead; on CPU these are plain tensors.
"""

from __future__ import annotations

import numpy as np
import torch


def pinned(a, device, dtype=None) -> torch.Tensor:
    """`a` (numpy array, list, CPU tensor) as a CPU tensor, in pinned memory when `device` is CUDA."""
    t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.pin_memory() if torch.device(device).type == "cuda" else t


def to_device(a, device, dtype=None) -> torch.Tensor:
    """`a` on `device`, copied without waiting for the work queued there."""
    t = pinned(a, device, dtype)
    return t.to(device, non_blocking=True) if torch.device(device).type == "cuda" else t
