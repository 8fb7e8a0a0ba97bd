"""A rank's device memory as the balancer reads it, to bound its micro-batches."""

from __future__ import annotations

import torch


class DeviceMemory:
    """A GPU's memory: its size, and the peak allocated between two readings (the caching allocator's
    own count, so reading it costs no synchronisation)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def take_peak_bytes(self) -> int:
        """The most bytes allocated at once since the last call, which starts the next count."""
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak
