"""Per-rank batch planning from measured speed: every GPU busy for the same time each step.

Speeds travel in each step's fused scalars (WeightedDDP metrics, one slot per rank), so every
rank sees the same numbers and computes the same plan without a collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hsync.data import split_proportionally

# Backward costs about twice the forward for transformer layers; the estimate only has to be
# right in proportion across ranks.
BACKWARD_TO_FORWARD = 2.0


def plan_batch_sizes(global_batch: int, speeds: list[float], max_sizes: list[int] | None = None) -> list[int]:
    """Micro-batch sizes proportional to `speeds` (examples/s) that add up to `global_batch`.

    Every rank gets at least one example when there are enough, and no rank more than its
    max_sizes entry (its memory headroom); what a capped rank cannot take goes to the others."""
    world = len(speeds)
    if global_batch < 1:
        raise ValueError(f"the global batch size must be positive, got {global_batch}")
    if any(s <= 0 for s in speeds):
        raise ValueError(f"every rank needs a positive measured speed, got {speeds}")
    caps = list(max_sizes) if max_sizes else [global_batch] * world
    if sum(caps) < global_batch:
        raise ValueError(f"global batch {global_batch} does not fit the ranks' memory (at most {sum(caps)})")
    floor = 1 if global_batch >= world else 0
    sizes = [floor] * world
    open_ranks = [r for r in range(world) if caps[r] > sizes[r]]
    while sum(sizes) < global_batch:
        extra = split_proportionally(global_batch - sum(sizes), [speeds[r] for r in open_ranks])
        for r, add in zip(open_ranks, extra, strict=True):
            sizes[r] = min(caps[r], sizes[r] + add)
        open_ranks = [r for r in open_ranks if sizes[r] < caps[r]]
    return sizes


def step_time(plan: list[int], speeds: list[float]) -> float:
    """How long a step of this plan takes at these speeds: the slowest rank's time."""
    return max(n / s for n, s in zip(plan, speeds, strict=True))


def parse_rank_values(text: str, world_size: int, what: str, default: float) -> list[float]:
    """'1=2.0,3=1.5' as a list of one value per rank (the others get `default`)."""
    values = [default] * world_size
    for item in filter(None, (part.strip() for part in text.split(","))):
        rank, sep, value = item.partition("=")
        if not sep or not rank.strip().isdigit() or int(rank) >= world_size:
            raise ValueError(f"{what}: '{item}' is not RANK=VALUE with a rank below {world_size}")
        values[int(rank)] = float(value)
    return values


@dataclass
class SpeedWindow:
    """Examples and compute seconds of every rank since the last plan."""

    examples: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, examples: list[float], seconds: list[float]) -> None:
        if not self.examples:
            self.examples, self.seconds = [0.0] * len(examples), [0.0] * len(examples)
        self.examples = [a + b for a, b in zip(self.examples, examples, strict=True)]
        self.seconds = [a + b for a, b in zip(self.seconds, seconds, strict=True)]

    def speeds(self) -> list[float]:
        """Examples per second of compute; a rank that had no examples gets the mean of the others."""
        measured = [n / t if n > 0 and t > 0 else None for n, t in zip(self.examples, self.seconds, strict=True)]
        known = [s for s in measured if s is not None] or [1.0]
        return [s if s is not None else sum(known) / len(known) for s in measured]
