"""A static device buffer with a host mirror, the runner's way of feeding inputs to captured graphs."""

from __future__ import annotations

import torch


class StagingBuffer:
    """A static device buffer plus a host mirror (pinned on CUDA, so the copy is asynchronous)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()  # numpy view: filling from Python lists is much cheaper than torch

    def upload(self, n: int) -> None:
        self.dev[:n].copy_(self.host[:n], non_blocking=True)

    def upload_range(self, lo: int, hi: int) -> None:
        self.dev[lo:hi].copy_(self.host[lo:hi], non_blocking=True)
