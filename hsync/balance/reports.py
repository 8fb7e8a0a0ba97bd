"""What each rank tells every rank about itself in a step's fused scalars, as typed values.

A rank's Report rides in the step's one reduction as WeightedDDP metrics, one slot per rank and field
(every other rank's slot holds 0, so the sum is each rank's own value): every rank reads the same
numbers, fits the same cost models and takes the same decisions, with no collective of its own. The
slots' names (hsync.balance.busy/3, ...: a StepStats' metrics show them) are this module's business alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class Report:
    """One rank's measurements, sent with a step (Note [Balancer]: they describe the step before it)."""

    busy_s: float
    """Its time for its previous step by the Balancer's clock (by default its own work, less its waits for peers),
    in seconds (0: not known)."""
    units: float
    """Its units of work (padded examples, or tokens) in that step."""
    capacity: float
    """The most units its memory allows in one micro-batch (0: not known, or no bound)."""
    split_through: int
    """One more than the last step its sampler has split (0: none)."""
    step: int
    """The global step it sends this with: the same on every rank, unless their Balancers were not loaded from
    the same state."""
    epoch: int
    """Its epoch at that step: the same on every rank, unless a rank skipped a micro-batch's backward (its later
    micro-batches then went one step late, into the next epoch)."""


class ReportCodec:
    """Reports in and out of a step's metrics, for `world_size` ranks."""

    # One per field of Report, in its order: the names a StepStats' metrics have carried all along.
    _QUANTITIES = ("busy", "units", "capacity", "split_through", "step", "epoch")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._names = [[f"hsync.balance.{quantity}/{rank}" for rank in range(world_size)]
                       for quantity in self._QUANTITIES]

    @property
    def metric_names(self) -> list[str]:
        """The metrics a WeightedDDP must declare to carry the reports."""
        return [name for per_rank in self._names for name in per_rank]

    def encode(self, rank: int, report: Report) -> dict[str, float]:
        """Rank `rank`'s report as its metrics for the step (the other ranks' slots are left out: 0)."""
        return {per_rank[rank]: float(value) for per_rank, value in zip(self._names, astuple(report), strict=True)}

    def decode(self, metrics: Mapping[str, float]) -> list[Report]:
        """Every rank's report, from a step's reduced metrics."""
        values = [[float(metrics[name]) for name in per_rank] for per_rank in self._names]
        return [Report(busy_s, units, capacity, int(round(split_through)), int(round(step)), int(round(epoch)))
                for busy_s, units, capacity, split_through, step, epoch in zip(*values, strict=True)]
