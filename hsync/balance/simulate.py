"""A simulated slow GPU, for benchmarks and tests on equal hardware."""

from __future__ import annotations

import time

import torch


class SimulatedSlowdown:
    """Makes this rank's steps `factor` times longer than its own work takes.

    A step's work runs from one step_done() to the pause() at its end, where the rank sleeps
    (factor - 1) times that work. Work is counted in CPU seconds of this process on the CPU, so what
    other processes do to the same cores (compete for them, or sleep and leave them free) does not
    change it; on a GPU it is the device's time, which pause() synchronises to read."""

    def __init__(self, factor: float, device: torch.device) -> None:
        if not (1.0 <= factor < float("inf")):
            raise ValueError(f"a simulated slowdown must be a finite factor >= 1, got {factor}")
        self.factor = factor
        self._device = device
        self._started = self._now()

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            return time.perf_counter()
        return time.process_time()

    def pause(self) -> None:
        """Sleeps for the rest of the slowed step: call it when the step's own work is done."""
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * (self._now() - self._started))

    def step_done(self) -> None:
        """Starts the next step's count: call it once a step is complete."""
        if self.factor > 1.0:
            self._started = self._now()
