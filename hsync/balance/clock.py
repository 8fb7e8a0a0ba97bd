"""How a Balancer times this rank's steps, and the one place a benchmark or test changes that."""

from __future__ import annotations

from collections.abc import Callable

from hsync.stats import StepStats


class StepClock:
    """A Balancer's clock: this rank's time for each step is its StepStats.busy_seconds, its own work less its
    waits for peers (Note [Busy time] in csrc/busy_clock.h). A benchmark or test hands Balancer(clock=...)
    another: a simulated slow GPU (hsync.balance.simulate), a known cost model."""

    def own_work_done(self, busy_so_far: Callable[[], float | None], units: float) -> None:
        """Called when a weighted step's own work on this rank is done, before its remaining collectives:
        `busy_so_far()` reads that work (None before the first step; on a GPU, reading waits for the device);
        `units`: the work this rank's step held."""

    def step_seconds(self, stats: StepStats, units: float) -> float | None:
        """This rank's time for the step whose StepStats is `stats`, in which it ran `units` of work (None: not
        known)."""
        return stats.busy_seconds

    def step_done(self) -> None:
        """Called once a step is complete."""
