"""Splitting one global batch among ranks of different speeds and memory, and fitting their costs.

Pure functions of their arguments (no torch, no clock): every rank computes the same split from
the same measurements, so plans need no collective of their own.

Note [Cost model]
A rank's step takes t_r(c) = fixed_r + c * per_unit_r seconds for c units of work, where a unit is an
example, or a token when examples have lengths. fixed_r is what a step costs whatever its size (the
optimizer, kernel launches, the reduction's tail); per_unit_r is the inverse of the rank's throughput.
Work is counted padded: a micro-batch of n examples whose longest costs m is n * m units, as a
padding collate makes it. A rank runs its share in micro-batches of at most micro_cap units each
(its memory), one after the other in a no_sync window, so compute share and memory fit are decided
separately. The step takes as long as its slowest rank: the split minimises the largest t_r.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hsync import _planner


@dataclass(frozen=True)
class RankCost:
    """One rank's predicted step time: fixed_s + units * per_unit_s (Note [Cost model])."""

    fixed_s: float
    """Seconds a step costs this rank whatever its size."""
    per_unit_s: float
    """Seconds per unit of work (example or token): the inverse of the rank's throughput."""
    micro_cap: float = math.inf
    """Most units of work in one micro-batch (what the rank's memory holds); at least one example always."""


def micro_batches(costs: Sequence[float], cap: float) -> list[tuple[int, int]]:
    """(start, stop) ranges of consecutive examples, costs sorted longest first, that fill micro-batches
    of at most `cap` padded units each (at least one example per micro-batch)."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(costs) + 1):
        if i == len(costs) or (i - start + 1) * costs[start] > cap:
            ranges.append((start, i))
            start = i
    return ranges


def padded_units(costs: Sequence[float], cap: float) -> float:
    """The units of work of these examples (longest first) in micro-batches of at most `cap` units."""
    return sum((stop - start) * costs[start] for start, stop in micro_batches(costs, cap))


def step_time(costs: Sequence[float], shares: Sequence[Sequence[int]], ranks: Sequence[RankCost]) -> float:
    """The predicted time of a step whose rank r runs the examples at positions shares[r]: the slowest
    rank's. A rank with no example still takes part in the step and pays its fixed cost."""
    def rank_time(share: Sequence[int], rank: RankCost) -> float:
        ordered = sorted((costs[i] for i in share), reverse=True)
        return rank.fixed_s + padded_units(ordered, rank.micro_cap) * rank.per_unit_s

    return max(rank_time(share, rank) for share, rank in zip(shares, ranks, strict=True))


def split_step(costs: Sequence[float], ranks: Sequence[RankCost]) -> list[list[int]]:
    """Each rank's examples of one step (positions into `costs`), with the shortest predicted step.

    The examples are ordered longest first (stably: equal costs keep their order) and each rank gets a
    run of consecutive ones, so micro-batches hold examples of similar length and pad little. With
    equal costs this is optimal among all splits; with lengths, among splits into such runs in rank
    order. Every rank gets at least one example while there are enough. The search is compiled
    (csrc/planner/, Note [Split search]): 1,024 ranks x 8 examples split in about a millisecond."""
    order, _, starts = _shortest_runs(costs, ranks)
    positions = order.tolist()
    return [positions[starts[r]:starts[r + 1]] for r in range(len(ranks))]


def split_time(costs: Sequence[float], planned_by: Sequence[RankCost], judged_by: Sequence[RankCost]) -> float:
    """The predicted time under the models `judged_by` of the step that split_step splits by `planned_by`:
    step_time(costs, split_step(costs, planned_by), judged_by), compiled, for weighing one plan against
    another at a thousand ranks within milliseconds."""
    _, ordered, starts = _shortest_runs(costs, planned_by)
    return _planner.split_time(ordered, starts, *_columns(judged_by))


def _shortest_runs(costs: Sequence[float], ranks: Sequence[RankCost]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(positions longest first, the costs in that order, each rank's start and the end) of split_step."""
    values = np.asarray(costs, dtype=np.float64)  # the compiled search checks the costs and the models
    order = np.argsort(-values, kind="stable")
    ordered = values[order]
    return order, ordered, _planner.shortest_split(ordered, *_columns(ranks))


def _columns(ranks: Sequence[RankCost]) -> tuple[list[float], list[float], list[float]]:
    return [r.fixed_s for r in ranks], [r.per_unit_s for r in ranks], [r.micro_cap for r in ranks]


def longest_first(costs: Sequence[float]) -> list[int]:
    """Positions of `costs`, longest first; equal costs keep their order."""
    return np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable").tolist()


def split_proportionally(total: int, weights: Sequence[float]) -> list[int]:
    """Integers in proportion to `weights` that add up to `total` (the largest remainders get the rest)."""
    if total < 0 or not weights or any(not (w >= 0) for w in weights) or not sum(weights) > 0:
        raise ValueError(f"cannot split {total} by weights {list(weights)}")
    exact = [total * w / sum(weights) for w in weights]
    sizes = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: sizes[i] - exact[i])[:total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def proportional_costs(weights: Sequence[float]) -> list[RankCost]:
    """Cost models under which split_step gives shares in proportion to `weights` (no fixed part)."""
    if not weights or any(not (w > 0) for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    return [RankCost(0.0, 1.0 / w) for w in weights]


def fit_affine(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(fixed, per_unit) of the weighted least-squares line time = fixed + units * per_unit through
    (units, time, weight) points, held to fixed >= 0 and per_unit > 0: a line through the origin when
    the points cannot place one (a single size, or a slope that noise made non-positive). None
    without a usable point."""
    usable = [(x, y, w) for x, y, w in points if x > 0 and y > 0 and w > 0 and math.isfinite(x) and math.isfinite(y)]
    if not usable:
        return None
    total = sum(w for _, _, w in usable)
    mean_x = sum(w * x for x, _, w in usable) / total
    mean_y = sum(w * y for _, y, w in usable) / total
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in usable)
    if sxx > 1e-12 * total * mean_x * mean_x:
        slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in usable) / sxx
        fixed = mean_y - slope * mean_x
        if slope > 0 and fixed >= 0:
            return fixed, slope
    return 0.0, sum(w * x * y for x, y, w in usable) / sum(w * x * x for x, _, w in usable)
