"""Ctrl-C and a cluster's preemption (SIGINT, SIGTERM) stop a run at the end of its current step, with a
checkpoint, on every rank together."""

from __future__ import annotations

import signal
from pathlib import Path


class StopRequest:
    """Turns SIGINT and SIGTERM into a request to stop after the current step.

    A rank's request rides in the step's fused scalars (the WeightedDDP metric METRIC), so every rank
    learns of any rank's signal at the same step and they stop together; no collective is added.
    Later signals change nothing: torchrun's agent forwards the Ctrl-C it got itself, and kills
    workers that are still running 30 s after it."""

    METRIC = "stop"

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum)

    @property
    def requested(self) -> float:
        """This rank's vote, as the value of the METRIC metric."""
        return 0.0 if self.signal is None else 1.0

    @property
    def exit_code(self) -> int:
        """The shell's code for death by this rank's signal (SIGTERM's where only another rank had one)."""
        return 128 + (self.signal or signal.SIGTERM)

    def summary(self, step: int, checkpoint: Path | None) -> str:
        what = self.signal.name if self.signal else "a signal to another rank"
        if checkpoint is None:
            return f"interrupted by {what} after step {step}; nothing saved (no --save-dir)"
        return f"interrupted by {what} after step {step}; checkpoint {checkpoint} written, continue with --resume"
