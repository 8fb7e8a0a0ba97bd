"""A rank's device memory as the balancer reads it, to bound its micro-batches."""

from __future__ import annotations

import torch


def obtainable_bytes(device: torch.device) -> int:
    """The most this process's allocations on `device` may reach in all: what the caching allocator holds and
    can still take from the device, or less where torch.cuda.set_per_process_memory_fraction caps it (the cap
    counts the allocator's own segments, whatever the card has free). Shared by the Balancer's micro-batches
    and hsync.ShardedOptimizer's shares (Note [Memory shares])."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device) + free
    return int(min(held, torch.cuda.get_per_process_memory_fraction(device) * total))


class DeviceMemory:
    """A GPU's memory: the peak of allocations between two readings, and what allocations may reach."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._most_allocated = 0  # over every reading so far
        self._most_reserved = 0

    def take_peak_bytes(self) -> int:
        """The most bytes allocated at once since the last call, which starts the next count (the caching
        allocator's own counts: reading them costs no synchronisation)."""
        allocated = torch.cuda.max_memory_allocated(self.device)
        self._most_allocated = max(self._most_allocated, allocated)
        self._most_reserved = max(self._most_reserved, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated

    def budget_bytes(self, fraction: float) -> float:
        """The most bytes allocations may reach at once: `fraction` of what they may reach in all
        (obtainable_bytes), less the allocator's own overhead. The device's free memory leaves out
        what the allocator does not count (the CUDA context, NCCL's buffers, library workspaces, other
        processes); the overhead is the most it has reserved over the most that was allocated (segments
        held for fragments and streams)."""
        usable = obtainable_bytes(self.device)
        overhead = self._most_reserved / self._most_allocated if self._most_allocated else 1.0
        return fraction * usable / overhead
