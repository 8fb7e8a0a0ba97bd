"""Per-rank batch planning from measured speed: every GPU busy for the same time each step.

Speeds travel in each step's fused scalars (WeightedDDP metrics, one slot per rank), so every
rank sees the same numbers and computes the same plan without a collective of its own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

# Backward costs about twice the forward for transformer layers; the estimate only has to be
# right in proportion across ranks.
BACKWARD_TO_FORWARD = 2.0
REPLAN_GAIN = 0.05  # a new batch plan must promise steps at least this much shorter


def plan_batch_sizes(global_batch: int, speeds: list[float], max_sizes: list[int] | None = None) -> list[int]:
    """Micro-batch sizes that add up to `global_batch` with the shortest step at these `speeds`
    (examples/s): each example goes to the rank that would finish it first. This is optimal for
    equal examples, unlike rounding shares in proportion (at 2.1:1, 32 examples split 21 + 11 in
    proportion and take 11 units, where 22 + 10 takes 10.5).

    Every rank gets at least one example when there are enough, and no rank more than its
    max_sizes entry (its memory headroom)."""
    world = len(speeds)
    if global_batch < 1:
        raise ValueError(f"the global batch size must be positive, got {global_batch}")
    if any(s <= 0 for s in speeds):
        raise ValueError(f"every rank needs a positive measured speed, got {speeds}")
    caps = list(max_sizes) if max_sizes else [global_batch] * world
    if sum(caps) < global_batch:
        raise ValueError(f"global batch {global_batch} does not fit the ranks' memory (at most {sum(caps)})")
    sizes = [1 if global_batch >= world else 0] * world
    # (time the rank would take with one more example, rank): ties go to the lower rank on every rank
    finish = [((sizes[r] + 1) / speeds[r], r) for r in range(world) if sizes[r] < caps[r]]
    heapq.heapify(finish)
    for _ in range(global_batch - sum(sizes)):
        _, r = heapq.heappop(finish)
        sizes[r] += 1
        if sizes[r] < caps[r]:
            heapq.heappush(finish, ((sizes[r] + 1) / speeds[r], r))
    return sizes


def step_time(plan: list[int], speeds: list[float]) -> float:
    """How long a step of this plan takes at these speeds: the slowest rank's time."""
    return max(n / s for n, s in zip(plan, speeds, strict=True))


def rebalance(plan: list[int], speeds: list[float], max_sizes: list[int] | None = None) -> list[int]:
    """The shortest plan at `speeds` for the same total (plan_batch_sizes), kept only if it is predicted
    to be clearly faster than `plan`: measured speeds are noisy, and a plan that flips on noise costs
    more than it wins. Every rank computes the same from the same speeds."""
    new = plan_batch_sizes(sum(plan), speeds, max_sizes)
    return new if step_time(new, speeds) <= (1 - REPLAN_GAIN) * step_time(plan, speeds) else plan


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
