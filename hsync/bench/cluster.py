"""A cluster of simulated ranks that runs the balancer's real policy, on one machine and without torch.

Each rank's step takes fixed + units * per_unit seconds, times its noise, and longer on a straggling
step; a rank may slow down (or speed up) from a given step on; its memory caps a micro-batch. The
policy (hsync.balance.policy) sees what a Balancer would: each rank's busy time and units of work per
step. The step's wall time adds the gradient all-reduce, from a ring model (Note [Ring all-reduce]).
`python -m hsync.bench --simulate-cluster` runs it at 8 to 1,024 ranks (simulate_cluster).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hsync.balance.planner import RankCost, padded_units, split_proportionally, split_step
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
    return float(padded_units(sorted(share_costs, reverse=True), cap))


# -- a cluster of mixed GPUs, at several sizes ---------------------------------------------------------

@dataclass(frozen=True)
class GpuType:
    """A kind of GPU, by its published single-GPU training throughput (docs/../benchmarks/simulated-cluster.md)."""

    name: str
    examples_per_s: float
    """ResNet-50 training images per second, one GPU, mixed precision."""
    memory_gib: float


# Published ResNet-50 v1.5 training throughputs, one GPU, mixed precision, batch 256 where stated: NVIDIA's
# DeepLearningExamples (A100, V100) and Lambda's benchmarks scaled to them (RTX 3090, A10); the sources are
# in benchmarks/simulated-cluster.md.
GPU_MIX = (GpuType("A100-80GB", 2470.0, 80.0), GpuType("V100-16GB", 1200.0, 16.0), GpuType("V100-32GB", 1156.0, 32.0),
           GpuType("RTX-3090", 905.0 * 1200 / 833, 24.0), GpuType("A10", 638.0 * 1200 / 833, 24.0))
_IMAGES_PER_GIB = 12.0  # ResNet-50 with mixed precision: about 256 images in 16 GiB, with room to spare


# Note [Ring all-reduce]
# A ring all-reduce of n bytes over w ranks takes 2 (w - 1) steps, each sending n / w over every link at
# once: 2 (w - 1) latencies, and 2 (w - 1) / w of the data over the slowest link, NVLink-class within a
# node, the network once the ring leaves it. The step adds it whole, for every split alike (DDP overlaps
# part of it with the backward; what it cannot hide is what a step waits for).


def ring_allreduce_s(nbytes: float, world: int, per_node: int = 8, latency_s: float = 10e-6,
                     intra_gbps: float = 100.0, inter_gbps: float = 12.5) -> float:
    """Seconds to all-reduce `nbytes` over `world` ranks in nodes of `per_node` (Note [Ring all-reduce]);
    bandwidths in GB/s."""
    if world == 1:
        return 0.0
    bandwidth = (intra_gbps if world <= per_node else inter_gbps) * 1e9
    return 2 * (world - 1) * latency_s + 2 * (world - 1) / world * nbytes / bandwidth


@dataclass(frozen=True)
class ClusterScenario:
    """What --simulate-cluster runs at each size (the assumptions its results page states)."""

    examples_per_rank: int = 16
    """The global batch is this many examples per rank."""
    steps: int = 300
    """Steps simulated per size."""
    warmup_steps: int = 40
    """Steps left out of the means: warm-up, probes and the first plans."""
    fixed_s: tuple[float, float] = (0.004, 0.010)
    """Each rank's fixed cost per step is drawn from this range (optimizer, launches)."""
    noise: float = 0.03
    """Relative spread of every step's time (lognormal sigma)."""
    straggler_rate: float = 0.0005
    """Chance that a rank's step straggles (3x as long): at 1,024 ranks, four steps in ten have one."""
    slowdown_step: int = 150
    """At this step one rank in a hundred (at least one) becomes twice as slow (throttling)."""
    gradient_bytes: float = 25.6e6 * 2
    """ResNet-50's gradients in bf16: what every step all-reduces."""
    seed: int = 0


def simulate_size(world: int, scenario: ClusterScenario = ClusterScenario()) -> dict:
    """One size of the simulated cluster: hsync's policy against the oracle's and DDP's equal split."""
    rng = np.random.default_rng(scenario.seed + world)
    kinds = [GPU_MIX[i] for i in rng.integers(len(GPU_MIX), size=world)]
    ranks = [SimulatedRank(float(rng.uniform(*scenario.fixed_s)), 1.0 / kind.examples_per_s, scenario.noise,
                           kind.memory_gib * _IMAGES_PER_GIB) for kind in kinds]
    slowed = sorted(rng.choice(world, size=max(1, world // 100), replace=False).tolist())
    cluster = SimulatedCluster(ranks, [SpeedChange(scenario.slowdown_step, r, 2.0) for r in slowed],
                               straggler_rate=scenario.straggler_rate,
                               allreduce_s=ring_allreduce_s(scenario.gradient_bytes, world), seed=scenario.seed)
    costs = [1.0] * (scenario.examples_per_rank * world)
    run, _ = cluster.run(PolicyConfig(world), costs, scenario.steps)
    steady = slice(scenario.warmup_steps, None)
    after = scenario.slowdown_step
    # Steps to adapt: from the change until hsync's steps are back within 5% of the oracle's, five in a row.
    within = [run.step_s[s] <= 1.05 * run.oracle_s[s] for s in range(after, scenario.steps)]
    adapt = next((i for i in range(len(within) - 4) if all(within[i:i + 5])), None)
    def mean_ms(times: list[float]) -> float:
        return 1e3 * float(np.mean(times[steady]))

    return {"ranks": world, "gpus": {k.name: sum(1 for x in kinds if x is k) for k in GPU_MIX},
            "hsync_ms": mean_ms(run.step_s), "oracle_ms": mean_ms(run.oracle_s), "equal_ms": mean_ms(run.equal_s),
            "allreduce_ms": 1e3 * cluster.allreduce_s,
            "steps_to_adapt": adapt, "planner_ms": 1e3 * float(np.mean(run.planner_s[steady])),
            "planner_p99_ms": 1e3 * float(np.percentile(run.planner_s[steady], 99)),
            "planner_max_ms": 1e3 * float(np.max(run.planner_s[steady]))}


def simulate_cluster(sizes: Sequence[int] = (8, 64, 256, 1024), scenario: ClusterScenario = ClusterScenario(),
                     markdown: str | None = None, plot: str | None = None, json_path: str | None = None) -> list[dict]:
    """Every size, printed as a table, and written where asked."""
    rows = []
    for world in sizes:
        rows.append(simulate_size(world, scenario))
        row = rows[-1]
        print(f"{world:5d} ranks: hsync {row['hsync_ms']:7.2f} ms, oracle {row['oracle_ms']:7.2f} ms "
              f"({row['oracle_ms'] / row['hsync_ms']:.1%} of it), equal split {row['equal_ms']:7.2f} ms "
              f"({row['equal_ms'] / row['hsync_ms']:.2f}x), adapted in {row['steps_to_adapt']} steps, "
              f"planner {row['planner_ms']:.2f} ms/step (99th percentile {row['planner_p99_ms']:.2f}, "
              f"max {row['planner_max_ms']:.2f})", flush=True)
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump({"scenario": scenario.__dict__, "rows": rows}, f, indent=1)
    if plot:
        _plot(rows, plot)
    if markdown:
        with open(markdown, "w") as f:
            f.write(_table(rows))
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| ranks | GPUs | hsync (ms) | oracle (ms) | hsync vs oracle | equal split (ms) | equal / hsync | "
             "all-reduce (ms) | steps to adapt | planner (ms/step: mean, p99, max) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gpus = ", ".join(f"{n} {name}" for name, n in r["gpus"].items() if n)
        lines.append(f"| {r['ranks']} | {gpus} | {r['hsync_ms']:.2f} | {r['oracle_ms']:.2f} | "
                     f"{r['oracle_ms'] / r['hsync_ms']:.1%} | {r['equal_ms']:.2f} | "
                     f"{r['equal_ms'] / r['hsync_ms']:.2f}x | {r['allreduce_ms']:.2f} | {r['steps_to_adapt']} | "
                     f"{r['planner_ms']:.2f}, {r['planner_p99_ms']:.2f}, {r['planner_max_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("equal_ms", "equal split (DDP)"), ("hsync_ms", "hsync"), ("oracle_ms", "oracle split")):
        ax.plot(ranks, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("mean step time (ms)")
    ax.set_title("Simulated mixed-GPU cluster (ResNet-50, 16 images per rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
