"""Host-to-device copies that do not wait for the device.

A plain `.to("cuda")` of a pageable host tensor synchronises the stream (PyTorch waits for the copy,
hence for everything queued before it). The worker launches step N+1 while step N runs, so its
uploads go through page-locked memory with non_blocking=True: the copy is queued on the stream
like a kernel, and the caching host allocator keeps the page-locked buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(values: Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh tensor of `values` on `device`, queued without a host sync on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    return to_device(host, device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA through page-locked memory, queued on the current stream."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
