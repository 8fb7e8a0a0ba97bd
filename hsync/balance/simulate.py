"""Simulated GPUs, for benchmarks and tests on equal hardware: a slow one (Balancer(..., clock=SimulatedSlowdown(f,
device)), and the same object's pause_ahead() and step_done() around a plain loop's steps), and one whose steps
cost more by a known affine cost (SimulatedCost)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hsync.balance.clock import StepClock


class SimulatedSlowdown(StepClock):
    """Makes this rank's steps `factor` times longer than its own work takes.

    A step's work runs from one step_done() to the next. own_work_done(), at the end of the work, sleeps
    (factor - 1) times it. Work is counted in CPU seconds of this process on the CPU, so what other
    processes do to the same cores (compete for them, or sleep and leave them free) does not change
    it. On a GPU it is `busy_so_far()` where given: the rank's own time on the device since its last step
    ended, less its waits for peers (Note [Busy time] in csrc/busy_clock.h). Counted as work, a wait for
    a faster peer (the step's total weight, say) made the slowed rank sleep for it too, and look slower
    the more examples its peers had. Without it, or before the first step has ended, it is the
    device's wall time less the sleeps; either reading synchronises.

    Handed to a Balancer as its clock, it pauses there when each step's own work is done."""

    def __init__(self, factor: float, device: torch.device) -> None:
        if not (1.0 <= factor < float("inf")):
            raise ValueError(f"a simulated slowdown must be a finite factor >= 1, got {factor}")
        self.factor = factor
        self._device = device
        self._started = self._now()
        self._slept = 0.0      # in the current step
        self._last_work = 0.0  # of the last complete step

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            return time.perf_counter()
        return time.process_time()  # a sleeping process uses none

    def _work(self) -> float:
        return self._now() - self._started - (self._slept if self._device.type == "cuda" else 0.0)

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self._slept += seconds

    def own_work_done(self, busy_so_far: Callable[[], float | None] | None = None, units: float = 0.0) -> None:
        """Sleeps for the rest of the slowed step: call it when the step's own work is done."""
        if self.factor > 1.0:
            busy = busy_so_far() if busy_so_far is not None and self._device.type == "cuda" else None
            self._sleep((self.factor - 1.0) * (self._work() if busy is None else busy))

    def pause_ahead(self, units: float = 0.0) -> None:
        """Sleeps (factor - 1) times the last complete step's work: for a loop that cannot pause at
        the end of its work (torch DDP's backward ends with the reduction), called before it."""
        if self.factor > 1.0:
            self._sleep((self.factor - 1.0) * self._last_work)

    def step_done(self) -> None:
        """Starts the next step's count: call it once a step is complete."""
        if self.factor > 1.0:
            self._last_work = self._work()
            self.restart()

    def restart(self) -> None:
        """Forgets the work since the last step: what ran in between was not this rank's steps (a
        benchmark's other variant)."""
        self._started, self._slept = self._now(), 0.0


class SimulatedCost(StepClock):
    """Adds `fixed_s` + `per_unit_s` x units of work to each of this rank's steps, slept, on top of its own work:
    a rank that does the same work as its peers but has a known affine cost of its own (a slower device, a
    framework's per-step work), with which the best split can be computed. Sleeps leave the cores to other
    processes, so ranks sharing a CPU's cores slow each other down only by their real work.

    Handed to a Balancer as its clock, it sleeps when each step's own work is done; a plain loop calls
    pause_ahead(n) before the backward of a step of n units, as it calls SimulatedSlowdown's."""

    def __init__(self, fixed_s: float, per_unit_s: float) -> None:
        if not (fixed_s >= 0.0 and per_unit_s >= 0.0):
            raise ValueError(f"a simulated cost must be >= 0, got {fixed_s} s per step and {per_unit_s} s per unit")
        self.fixed_s, self.per_unit_s = fixed_s, per_unit_s

    def seconds(self, units: float) -> float:
        """The simulated part of a step that holds `units`."""
        return self.fixed_s + self.per_unit_s * units

    def pause_ahead(self, units: float) -> None:
        time.sleep(self.seconds(units))

    def own_work_done(self, busy_so_far: Callable[[], float | None], units: float) -> None:
        self.pause_ahead(units)

    def restart(self) -> None:
        """Nothing to forget: a step's cost depends on its units alone."""
