"""One row of the benchmark's results, and the variants each training row times."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from hsync.collectives import Channels

MIB = 1024 * 1024
NAN = float("nan")
# hsync: WeightedDDP with model.backward(loss, weight=n), the exact weighted step; hsync_plain: the same
# wrapper with loss.backward(), DDP's own semantics; nosync: the bare model, the floor.
VARIANTS = ("hsync", "hsync_plain", "ddp", "nosync")
LABELS = {"hsync": "hsync, backward(loss, weight)", "hsync_plain": "hsync, loss.backward()", "ddp": "torch DDP",
          "nosync": "no sync"}
MEMORY_VARIANTS = ("hsync", "ddp", "nosync")  # hsync_plain keeps the same buffers as hsync


@dataclass
class Result:
    """One workload's numbers; step times are medians and 90th percentiles over timed steps."""

    workload: str
    hsync_step_s: float
    ddp_step_s: float
    nosync_step_s: float
    hsync_p90_s: float
    ddp_p90_s: float
    nosync_p90_s: float
    samples_per_step: int
    hsync_plain_step_s: float = NAN
    hsync_plain_p90_s: float = NAN
    ratio_vs_ddp: float = 0.0
    plain_ratio_vs_ddp: float = 0.0
    hsync_overhead_vs_nosync: float = 0.0
    ddp_overhead_vs_nosync: float = 0.0
    peak_memory_mb: dict[str, float] = field(default_factory=dict)
    """Per variant: peak MiB of live tensors in a training step, plus what wrapping the model kept
    (buckets), over the bare model's parameters (see training_memory_mb)."""
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ratio_vs_ddp = self.hsync_step_s / self.ddp_step_s
        self.plain_ratio_vs_ddp = self.hsync_plain_step_s / self.ddp_step_s
        self.hsync_overhead_vs_nosync = self.hsync_step_s / self.nosync_step_s - 1
        self.ddp_overhead_vs_nosync = self.ddp_step_s / self.nosync_step_s - 1


def slowest_rank_quantiles(times: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's median and 90th-percentile step, every step taken as long as on its slowest rank
    (where all ranks wait for it)."""
    stacked = Channels.of_group().max_over_ranks(torch.tensor(list(times.values()), dtype=torch.float64),
                                                 "the benchmark's step times")
    rows = dict(zip(times, stacked.tolist(), strict=True))
    return ({k: statistics.median(v) for k, v in rows.items()},
            {k: statistics.quantiles(v, n=10)[-1] for k, v in rows.items()})
