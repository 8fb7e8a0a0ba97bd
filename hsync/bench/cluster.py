"""A cluster of simulated ranks that runs the balancer's real policy, on one machine and without torch.

Each rank's step takes fixed + units * per_unit seconds, times its noise, and longer on a straggling
step; a rank may slow down (or speed up) from a given step on; its memory caps a micro-batch. The
policy (hsync.balance.policy) sees what a Balancer would: each rank's busy time and units of work per
step. The step's wall time adds the gradient all-reduce, from a ring model (Note [Ring all-reduce]).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hsync.balance.planner import RankCost, micro_batches, split_proportionally, split_step
from hsync.balance.policy import Policy, PolicyConfig


@dataclass(frozen=True)
class SimulatedRank:
    """One simulated GPU."""

    fixed_s: float
    """Seconds a step costs it whatever its size (optimizer, launches)."""
    per_unit_s: float
    """Seconds per example (or token): the inverse of its throughput."""
    noise: float = 0.0
    """Relative spread of its step times (each step is multiplied by a lognormal factor of this sigma)."""
    micro_cap: float = math.inf
    """Most units of work its memory holds in one micro-batch."""


@dataclass(frozen=True)
class SpeedChange:
    """From `step` on, rank `rank` takes `factor` times as long per unit (3: a GPU that throttles)."""

    step: int
    rank: int
    factor: float


@dataclass
class ClusterRun:
    """What a simulated run measured, step by step."""

    plans: list[list[int]] = field(default_factory=list)
    """Examples of each rank, per step."""
    step_s: list[float] = field(default_factory=list)
    """Each step's simulated wall time: the slowest rank plus the all-reduce."""
    oracle_s: list[float] = field(default_factory=list)
    """The same step's time under the best split for the true speeds, with the same noise and stragglers."""
    equal_s: list[float] = field(default_factory=list)
    """The same step's time under DDP's equal split, with the same noise and stragglers."""
    planner_s: list[float] = field(default_factory=list)
    """Host seconds the policy and the split took per step."""


class SimulatedCluster:
    """Ranks of given speeds, noise, stragglers and speed changes, stepped by the real policy."""

    def __init__(self, ranks: Sequence[SimulatedRank], changes: Sequence[SpeedChange] = (),
                 straggler_rate: float = 0.0, straggler_factor: float = 3.0, allreduce_s: float = 0.0,
                 seed: int = 0) -> None:
        self.ranks = list(ranks)
        self.changes = sorted(changes, key=lambda c: c.step)
        self.straggler_rate, self.straggler_factor = straggler_rate, straggler_factor
        self.allreduce_s = allreduce_s
        self._rng = np.random.default_rng(seed)
        self._fixed = np.array([r.fixed_s for r in self.ranks])
        self._noise = np.array([r.noise for r in self.ranks])
        self.caps = [r.micro_cap for r in self.ranks]
        self._drawn_step, self._factors = -1, np.ones(len(self.ranks))

    def per_unit(self, step: int) -> np.ndarray:
        """Each rank's true seconds per unit at `step`."""
        per_unit = np.array([r.per_unit_s for r in self.ranks])
        for change in self.changes:
            if change.step <= step:
                per_unit[change.rank] *= change.factor
        return per_unit

    def true_models(self, step: int) -> list[RankCost]:
        return [RankCost(f, p, c) for f, p, c in zip(self._fixed, self.per_unit(step), self.caps, strict=True)]

    def busy(self, step: int, units: np.ndarray) -> np.ndarray:
        """Each rank's busy seconds for `units` of work at `step`: its model, its noise, and a straggler's delay
        (drawn once per step, so that splits of the same step compare under the same conditions)."""
        if self._drawn_step != step:
            noise = np.exp(self._noise * self._rng.standard_normal(len(self.ranks)))
            straggling = self._rng.random(len(self.ranks)) < self.straggler_rate
            self._factors, self._drawn_step = np.where(straggling, noise * self.straggler_factor, noise), step
        return (self._fixed + units * self.per_unit(step)) * self._factors

    def oracle_shares(self, step: int, costs: Sequence[float]) -> list[list[int]]:
        """The best split of `costs` given the true speeds at `step`."""
        return split_step(costs, self.true_models(step))

    def equal_shares(self, costs: Sequence[float]) -> list[list[int]]:
        """DDP's split: the same number of examples on every rank."""
        bounds = np.cumsum([0, *split_proportionally(len(costs), [1.0] * len(self.ranks))])
        return [list(range(bounds[r], bounds[r + 1])) for r in range(len(self.ranks))]

    def step_s(self, step: int, costs: Sequence[float], shares: list[list[int]]) -> float:
        """A step's wall time when ranks run these shares: the slowest rank, plus the all-reduce."""
        units = np.array([_padded_units([costs[i] for i in share], cap) for share, cap in
                          zip(shares, self.caps, strict=True)])
        return float(self.busy(step, units).max()) + self.allreduce_s

    def run(self, config: PolicyConfig, costs: Sequence[float], steps: int, policy: Policy | None = None,
            first_step: int = 0) -> tuple[ClusterRun, Policy]:
        """Runs `steps` steps of `costs` (one step's examples) from `first_step`, planned by `policy` (a new one
        from `config` if None), as a Balancer runs them."""
        policy = policy or Policy(config, first_step)
        record = ClusterRun()
        equal = self.equal_shares(costs)
        oracle: tuple[list[float], list[list[int]]] = ([], [])
        for step in range(first_step, first_step + steps):
            started = time.perf_counter()
            models = policy.models_for(step, self.caps)
            shares = split_step(costs, models)
            planned = time.perf_counter() - started
            units = np.array([_padded_units([costs[i] for i in share], cap) for share, cap in
                              zip(shares, [m.micro_cap for m in models], strict=True)])
            busy = self.busy(step, units)
            started = time.perf_counter()
            policy.observe(step, busy, units, full=True)
            if policy.due(step):
                policy.decide(step, costs, step + 1, self.caps)
            record.planner_s.append(planned + time.perf_counter() - started)
            record.plans.append([len(share) for share in shares])
            record.step_s.append(float(busy.max()) + self.allreduce_s)
            speeds = self.per_unit(step).tolist()
            if oracle[0] != speeds:
                oracle = (speeds, self.oracle_shares(step, costs))
            record.oracle_s.append(self.step_s(step, costs, oracle[1]))
            record.equal_s.append(self.step_s(step, costs, equal))
        return record, policy


def _padded_units(share_costs: list[float], cap: float) -> float:
    ordered = sorted(share_costs, reverse=True)
    return float(sum((b - a) * ordered[a] for a, b in micro_batches(ordered, cap)))
