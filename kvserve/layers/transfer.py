"""Host-built step inputs on the device without stopping the host (async scheduling, engine/core.py)."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A step's host-built inputs (indices, positions, per-row settings) on `device`. To a GPU through
    pinned memory, queued without stopping the host: a plain copy would wait for every kernel queued
    before it, the step ahead's too under async scheduling. The caching host allocator keeps the pinned
    block until the copy has run; a `host` pinned already is that block, not to be written meanwhile.
    Made contiguous first: a strided pinned source would be copied through a pageable temporary."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)


def on_device(device: torch.device | str, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A list of `values` (indices, per-row settings) as a tensor on `device`, through `to_device`."""
    return to_device(torch.tensor(values, dtype=dtype), device)
