"""Host-to-device helpers shared by the layers and the model runner."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor of ``dtype`` on ``device`` without a host-device
    sync: on CUDA it is staged in pinned memory (torch's caching host allocator keeps the block
    until the copy is done) and copied asynchronously; copies from pageable memory may wait for
    the stream, which would stall the decode loop."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype)
    host = torch.empty(len(values), dtype=dtype, pin_memory=True)
    host.copy_(torch.as_tensor(values, dtype=dtype))
    return host.to(device, non_blocking=True)
