"""What a rank's memory holds and allows: the one memory model behind the Balancer's micro-batches (MicroBatchMemory,
Note [Out of memory] in balancer.py) and hsync.ShardedOptimizer's shares (StateBytes, Note [Memory shares] in
hsync/sharding/shares.py)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from hsync.balance.planner import fit_affine

if TYPE_CHECKING:
    from hsync.ddp import WeightedDDP

_BIN_RATIO = 1.1  # measurements of sizes within 10% of each other share a bin
_BINS = 8  # sizes remembered; the least recently seen is dropped
_BIN_DEPTH = 16  # measurements per size; their median is the bin's peak
_BIN_QUORUM = 3
_CAPACITY_GROWTH = 2.0  # a micro-batch may grow at most this much beyond the largest one measured


def obtainable_bytes(device: torch.device) -> int:
    """The most this process's allocations on `device` may reach in all: what the caching allocator holds and
    can still take from the device, or less where torch.cuda.set_per_process_memory_fraction caps it (the cap
    counts the allocator's own segments, whatever the card has free). Shared by the Balancer's micro-batches
    and hsync.ShardedOptimizer's shares (Note [Memory shares])."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device) + free
    return int(min(held, torch.cuda.get_per_process_memory_fraction(device) * total))


class PeakMemory(Protocol):
    """What the Balancer reads of a device's memory: a DeviceMemory, or a test's simulated device."""

    def take_peak_bytes(self) -> int: ...

    def budget_bytes(self, fraction: float) -> float: ...


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


@dataclass
class _PeakFit:
    """Peak memory against units of work, binned by size."""

    bins: dict[int, deque] = field(default_factory=dict)

    def add(self, units: float, value: float) -> None:
        key = round(math.log(units) / math.log(_BIN_RATIO))
        points = self.bins.pop(key, None) or deque(maxlen=_BIN_DEPTH)
        points.append((units, value))
        self.bins[key] = points  # most recently seen last
        while len(self.bins) > _BINS:
            del self.bins[next(iter(self.bins))]

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_unit) through each bin's median, weighted by its measurements (Note [Cost model]
        in planner.py). Bins of fewer than _BIN_QUORUM measurements count only while no bin has more:
        a size seen once (an epoch's short last step) is a guess, not a measurement."""
        bins = [p for p in self.bins.values() if len(p) >= _BIN_QUORUM] or list(self.bins.values())
        return fit_affine([(statistics.fmean(u for u, _ in p), statistics.median(v for _, v in p), len(p))
                           for p in bins])

    def largest_units(self) -> float:
        return max((u for points in self.bins.values() for u, _ in points), default=0.0)


class MicroBatchMemory:
    """The largest micro-batch a GPU rank's memory allows, from the peaks of those it ran (Note [Out of memory] in
    balancer.py)."""

    def __init__(self, device: PeakMemory, fraction: float) -> None:
        self._device = device
        self._fraction = fraction
        self._fit = _PeakFit()
        self._largest_run = 0.0  # units of the largest micro-batch run
        self._ceiling = math.inf  # half the smallest micro-batch that ran out of memory

    def may_run_out(self, units: float) -> bool:
        """Whether a micro-batch of `units` is larger than any this rank has run."""
        return units > self._largest_run

    def measure(self, units: float) -> None:
        """After a micro-batch of `units` ran its backward: the peak since the last one's (its forward and
        backward, and the optimizer step before it when it is a step's first). The engine's buckets are resident
        throughout, so they are part of the fitted base."""
        self._fit.add(units, float(self._device.take_peak_bytes()))
        self._largest_run = max(self._largest_run, units)

    def ran_out(self, units: float) -> None:
        """A micro-batch of `units` ran out of memory: its peak is no measurement, and half of it is the most from
        now on."""
        self._device.take_peak_bytes()
        self._ceiling = min(self._ceiling, units / 2)

    def forget(self) -> None:
        """The model trains other parameters now (WeightedDDP.refresh_trainable_parameters): its peaks so far no
        longer hold, so every size may run out again until measured anew. A size that ran out still would."""
        self._fit = _PeakFit()
        self._largest_run = 0.0

    def capacity(self) -> float:
        """The largest micro-batch in units by the measured peaks, at most half of one that ran out of memory
        (0: not known)."""
        capacity = self._ceiling
        line = self._fit.line()
        if line is not None:
            base, per_unit = line
            room = self._device.budget_bytes(self._fraction) - base
            capacity = min(capacity, room / per_unit, _CAPACITY_GROWTH * self._fit.largest_units())
        return 0.0 if math.isinf(capacity) else max(1.0, capacity)


class StateBytes:
    """What a model's training state takes on a rank, per byte of parameter, for the ShardedOptimizer's shares
    (Note [Memory shares] in hsync/sharding/shares.py)."""

    def __init__(self, model: WeightedDDP, optimizer_class: type[torch.optim.Optimizer], defaults: Mapping) -> None:
        self._model = model
        self._optimizer_class, self._defaults = optimizer_class, defaults

    def owned_per_parameter_byte(self) -> float:
        """What a rank keeps per byte of a parameter it owns: its gradient and the optimizer state."""
        return self.gradient_per_parameter_byte() + self.optimizer_state_per_parameter_byte()

    def gradient_per_parameter_byte(self) -> float:
        """What a gradient kept takes per byte of its parameter: its bucket slot, which is also its .grad with
        gradient_as_bucket_view (a .grad of its own beside it otherwise)."""
        model = self._model
        element = next(p for p in model.parameters() if p.requires_grad).element_size()
        slot = torch.empty((), dtype=model.comm_dtype).element_size() / element if model.comm_dtype else 1.0
        views = model.gradient_as_bucket_view and model.comm_dtype is None
        return slot + (0.0 if views else 1.0)

    def in_flight(self, sizes: list[int]) -> int:
        """What a backward holds at once beyond the owned buckets: the two buffers another rank's buckets take
        turns in (one filling while the other's reduce runs: Note [Owned buckets] in csrc/engine.cpp), each a
        bucket's size (a parameter larger than the bucket cap is a bucket of its own), and a fresh gradient from
        autograd on its way into one. `sizes`: the trainable parameters' bytes."""
        settings = self._model._settings
        bucket = min(sum(sizes), max(settings.bucket_bytes_cap, settings.first_bucket_bytes_cap, max(sizes)))
        return 2 * bucket + max(sizes)

    def optimizer_state_per_parameter_byte(self) -> float:
        """How many bytes of state the optimizer keeps per byte of parameter (AdamW's two moments: 2), from one
        step on a small parameter: the state tensors of the parameter's size."""
        probe = torch.zeros(16, device=self._model.device, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        optimizer = self._optimizer_class([probe], **self._defaults)
        optimizer.step()
        state = optimizer.state[probe].values()
        sized = [t for t in state if isinstance(t, torch.Tensor) and t.numel() == probe.numel()]
        return sum(t.numel() * t.element_size() for t in sized) / (probe.numel() * probe.element_size())
