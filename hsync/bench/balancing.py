"""Mixed-speed rows: hsync.Balancer against DDP's equal batches, ranks slowed by a known factor, by a known affine
cost, or by real compute (a rank that runs its model twice)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hsync
from hsync.balance.simulate import SimulatedCost, SimulatedSlowdown
from hsync.bench.result import NAN, Result, slowest_rank_quantiles
from hsync.bench.workloads import bert_workload, masked_batch
from hsync.collectives import Channels
from hsync.compat import DDP_DEPRECATES_BROADCAST_BUFFERS


def pace(quick: bool) -> dict[str, int]:
    """The Balancer's warm-up, probes and refit period for a mixed-speed row (BalanceConfig's fields): a quick
    run, which checks that the command runs, plans after 1 + 3 steps and refits every 5; a measured one after
    2 + 9 and every 10."""
    return dict(warmup_steps=1, probe_steps=1, replan_every=5) if quick else dict(replan_every=10)


SimulatedClock = SimulatedSlowdown | SimulatedCost  # a simulated rank: its Balancer's clock, a plain loop's pauses


@dataclass(frozen=True)
class Slowed:
    """Rank r's steps take factors[r] times its own work (SimulatedSlowdown)."""

    factors: list[float]

    @property
    def world_size(self) -> int:
        return len(self.factors)

    def clock(self, rank: int, device: torch.device) -> SimulatedSlowdown:
        return SimulatedSlowdown(self.factors[rank], device)

    def ideal_speedup(self) -> float:
        """If every step of rank r takes f_r times its work, the best split finishes all ranks together and beats
        equal batches by max(f) * sum(1 / f) / world, whatever the fixed part of a step, on independent devices."""
        return max(self.factors) * sum(1 / f for f in self.factors) / len(self.factors)


@dataclass(frozen=True)
class AffineCosts:
    """Every step of rank r costs fixed_s + per_example_s[r] x its examples on top of its own work (SimulatedCost,
    slept): work per example and per step, as in real training, with a known best split."""

    fixed_s: float
    per_example_s: list[float]

    @property
    def world_size(self) -> int:
        return len(self.per_example_s)

    def clock(self, rank: int, device: torch.device) -> SimulatedCost:
        return SimulatedCost(self.fixed_s, self.per_example_s[rank])


def attainable(step_alone: Callable[[int], None], global_batch: int, plain_equal_s: float, hsync_s: float,
               steps: int, device: torch.device) -> dict[str, float]:
    """The attainable step of two ranks, what it rests on, and `of_attainable`: the throughput of hsync's measured
    step (`hsync_s`) over the attainable one.

    Each rank's step alone (`step_alone(n)`: its forward, backward and optimizer step over n examples, no
    collective, plus its simulated cost) is timed at a sweep of shares and fitted by a line, t_r(n); the best
    split minimises max(t_0(n), t_1(B - n)). The plain framework's step on equal shares (`plain_equal_s`, measured
    in the rounds) less the slower rank's alone at that share is what synchronising and the framework's per-batch
    work add; the attainable step is the best split's plus that."""
    channel = Channels.of_group()
    if channel.world_size != 2:
        raise ValueError(f"the attainable step is computed for two ranks, not {channel.world_size}")
    shares = sorted({*range(1, global_batch, max(1, global_batch // 16)), global_batch // 2, global_batch - 1})
    medians = []
    for n in shares:
        channel.barrier("the benchmark's barrier before a share timed alone")
        medians.append(statistics.median(_timed(partial(step_alone, n), steps, device)))
    alone = channel.gather(torch.tensor(medians, dtype=torch.float64), "the benchmark's steps alone").numpy()
    lines = [np.polyfit(shares, alone[r], 1) for r in range(2)]  # (per example, fixed) of each rank

    def t(r: int, n: int) -> float:
        return float(np.polyval(lines[r], n))

    best = min(range(1, global_batch), key=lambda n: max(t(0, n), t(1, global_batch - n)))
    best_s = max(t(0, best), t(1, global_batch - best))
    equal = global_batch // 2
    overhead_s = plain_equal_s - max(t(0, equal), t(1, global_batch - equal))
    extra = {"attainable_step_s": best_s + overhead_s, "of_attainable": (best_s + overhead_s) / hsync_s,
             "attainable_rank0": float(best), "plain_overhead_s": overhead_s}
    extra |= {f"alone_fixed_s_rank{r}": float(line[1]) for r, line in enumerate(lines)}
    extra |= {f"alone_per_example_s_rank{r}": float(line[0]) for r, line in enumerate(lines)}
    return extra


class SplitLog:
    """The split of each step a Balancer ran (rows of equal examples: one plan, one split), for a row's count of
    how often the plan moved while it was timed."""

    def __init__(self) -> None:
        self.splits: list[list[int]] = []

    def record(self, balancer: hsync.Balancer) -> None:
        self.splits.append(list(balancer.last_plan))

    def changes(self) -> int:
        return sum(a != b for a, b in pairwise(self.splits))


def mixed_speeds(name: str, device: torch.device, simulated: Slowed | AffineCosts, rounds: int, steps: int,
                 quick: bool) -> Result:
    """Ranks of simulated speeds (`simulated`: slowed by factors, or costs added): hsync.Balancer planning from
    measurements against DDP with equal batches, in samples per second. Rounds of each alternate; the first step
    of a round, which carries the switch, is not timed.

    Slowed, the best split is known (Slowed.ideal_speedup); ranks on a CPU share its cores: at that split they
    would compute sum(1 / f) cores' worth at once, and with fewer cores the best is less
    (`cores_bound_speedup`). With affine costs, `of_attainable` is the throughput over the attainable one
    (see attainable()). Where there is a core per rank, each rank keeps to its own (core_per_rank)."""
    with core_per_rank(device) as pinned:
        result = _mixed_speeds(name, device, simulated, rounds, steps, quick)
    result.extra["core_per_rank"] = float(pinned)
    return result


@contextmanager
def core_per_rank(device: torch.device) -> Iterator[bool]:
    """Pins every thread of this process (its compute, autograd's, gloo's) to a core of its own while the
    machine has a core for each of its ranks, as independent devices compute apart: a slow rank's core
    sleeps with it rather than running a fast rank's threads, which would make the fast rank's speed
    depend on what the slow one does. Yields whether it pinned."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []  # Linux only
    local_rank, local_world = (int(os.environ.get(k, v)) for k, v in
                               (("LOCAL_RANK", dist.get_rank()), ("LOCAL_WORLD_SIZE", dist.get_world_size())))
    if device.type != "cpu" or local_world > len(cores):
        yield False
        return
    _pin_threads({cores[local_rank]})
    try:
        yield True
    finally:
        _pin_threads(set(cores))


def _pin_threads(cores: set[int]) -> None:
    for thread in os.listdir("/proc/self/task"):
        with suppress(ProcessLookupError):  # ended meanwhile
            os.sched_setaffinity(int(thread), cores)


def _mixed_speeds(name: str, device: torch.device, simulated: Slowed | AffineCosts, rounds: int, steps: int,
                  quick: bool) -> Result:
    rank, world = dist.get_rank(), dist.get_world_size()
    if simulated.world_size != world:
        raise ValueError(f"{simulated} is for {simulated.world_size} ranks, not {world}")
    hidden, layers, batch, seq = (32, 1, 4, 32) if quick else (128, 2, 32, 64)
    vocab = 8000
    if isinstance(simulated, AffineCosts):  # a tiny model: the simulated costs, of known best split, are most of a step
        hidden, layers, seq, vocab = 32, 1, 32, 1000
    workload = bert_workload("mixed", hidden, layers, batch, seq, device, vocab=vocab)
    global_batch = workload.samples * world
    pool = masked_batch(torch.Generator().manual_seed(0), 8 * global_batch, seq, vocab, device)  # alike everywhere

    # BERT's buffers are constants: broadcasting them would only add a meeting point to each step.
    # Turned off by the name this torch's DDP takes: torch 2.11's has only broadcast_buffers, later
    # ones deprecate it.
    no_buffer_sync = {"forward_sync_buffers" if DDP_DEPRECATES_BROADCAST_BUFFERS else "broadcast_buffers": False}
    torch.manual_seed(0)
    ours = hsync.WeightedDDP(workload.make_model(), **no_buffer_sync)
    torch.manual_seed(0)
    theirs = DistributedDataParallel(workload.make_model(), **no_buffer_sync)
    our_slowdown, ddp_slowdown = simulated.clock(rank, device), simulated.clock(rank, device)
    balancer = hsync.Balancer(ours, len(pool[0]), hsync.BalanceConfig(global_batch_size=global_batch, **pace(quick)),
                              clock=our_slowdown)
    optimizers = {"hsync": torch.optim.SGD(ours.parameters(), lr=1e-4),
                  "ddp": torch.optim.SGD(theirs.parameters(), lr=1e-4)}

    def micro_batches() -> Iterator[list[int]]:
        while True:
            yield from balancer

    hsync_batches = micro_batches()
    ddp_cursor = 0
    split_log = SplitLog()

    def hsync_step() -> None:
        while True:
            indices = next(hsync_batches)
            loss = workload.loss(ours, tuple(t[indices] for t in pool))
            if balancer.backward(loss) is not None:
                break
        optimizers["hsync"].step()
        optimizers["hsync"].zero_grad()
        split_log.record(balancer)

    def ddp_step() -> None:
        nonlocal ddp_cursor
        share = workload.samples
        start = (ddp_cursor + rank * share) % len(pool[0])
        ddp_cursor += global_batch
        loss = workload.loss(theirs, tuple(t[start:start + share] for t in pool))
        ddp_slowdown.pause_ahead(share)  # before the backward, which ends with the reduction
        loss.backward()
        optimizers["ddp"].step()
        optimizers["ddp"].zero_grad()
        ddp_slowdown.step_done()

    def timed(step: Callable[[], None], count: int) -> list[float]:
        slowdown = our_slowdown if step is hsync_step else ddp_slowdown
        slowdown.restart()  # the other variant's work is no part of this one's first step
        return _timed(step, count, device)

    # Warm-up: the balancer's warm-up and probe steps and its measurement of the equal split, until
    # the plan from measurements is in force.
    while balancer.decisions < 2:
        hsync_step()
    for _ in range(2):
        hsync_step()
    first_plan = balancer.planned_split()
    timed(ddp_step, 2)
    split_log.splits.clear()
    times: dict[str, list[float]] = {"hsync": [], "ddp": []}
    for _ in range(rounds):
        times["hsync"] += timed(hsync_step, steps)
        times["ddp"] += timed(ddp_step, steps)
    med, p90 = slowest_rank_quantiles(times)
    hs, dd, hs90, dd90 = med["hsync"], med["ddp"], p90["hsync"], p90["ddp"]
    extra = {"hsync_samples_per_s": global_batch / hs, "ddp_samples_per_s": global_batch / dd,
             "speedup_vs_ddp": dd / hs}
    if isinstance(simulated, Slowed):
        extra["ideal_speedup"] = simulated.ideal_speedup()
        if device.type == "cpu":
            # At the ideal split rank r computes 1 / f_r of the time: ranks sharing too few cores cannot.
            demand = sum(1 / f for f in simulated.factors) / (os.cpu_count() or 1)
            extra["cores_bound_speedup"] = extra["ideal_speedup"] / max(1.0, demand)
    else:
        torch.manual_seed(0)
        bare = workload.make_model()
        bare_optimizer = torch.optim.SGD(bare.parameters(), lr=1e-4)
        bare_cost = simulated.clock(rank, device)

        def step_alone(n: int) -> None:
            workload.loss(bare, tuple(t[:n] for t in pool)).backward()
            bare_cost.pause_ahead(n)
            bare_optimizer.step()
            bare_optimizer.zero_grad()

        extra |= attainable(step_alone, global_batch, dd, hs, steps, device)
    extra |= {f"first_plan_rank{r}": n for r, n in enumerate(first_plan)}
    extra |= {f"plan_rank{r}": n for r, n in enumerate(balancer.last_plan)}
    extra["plan_changes"] = split_log.changes()
    # What the balancer measured: each rank's time per example, over the fastest rank's (the simulated
    # factor, less what of the work's wall time the CPU-time pause does not stretch).
    fitted = balancer.fitted_costs()
    fastest = min(c.per_unit_s for c in fitted)
    extra |= {f"measured_slowdown_rank{r}": c.per_unit_s / fastest for r, c in enumerate(fitted)}
    extra |= fitted_costs(balancer)
    return Result(name, hs, dd, NAN, hs90, dd90, NAN, global_batch, extra=extra)


def fitted_costs(balancer: hsync.Balancer) -> dict[str, float]:
    """Each rank's cost model as the Balancer fitted it (units: examples), to set beside what was measured."""
    extra = {}
    for r, cost in enumerate(balancer.fitted_costs()):
        extra |= {f"fitted_fixed_s_rank{r}": cost.fixed_s, f"fitted_per_example_s_rank{r}": cost.per_unit_s}
    return extra


def mixed_compute(name: str, device: torch.device, repeats: list[int], rounds: int, steps: int,
                  quick: bool) -> Result:
    """Ranks of really different speed: rank r runs its model `repeats[r]` times per example (each on a
    core of its own where the machine has one per rank, so that nothing but compute differs), with the
    noise real compute has. hsync.Balancer planning from its measurements against DDP's equal batches and
    against a sweep of fixed splits measured in the same rounds; the fastest fixed split is the oracle.
    Samples per second; rounds of every variant alternate."""
    with core_per_rank(device) as pinned:
        result = _mixed_compute(name, device, repeats, rounds, steps, quick)
    result.extra["core_per_rank"] = float(pinned)
    return result


def _mixed_compute(name: str, device: torch.device, repeats: list[int], rounds: int, steps: int,
                   quick: bool) -> Result:
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(repeats) != world or world != 2:
        raise ValueError(f"{name}: a sweep of fixed splits needs two ranks, got repeats {repeats} for {world}")
    hidden, layers, batch, seq = (32, 1, 4, 32) if quick else (128, 2, 32, 64)
    workload = bert_workload("mixed", hidden, layers, batch, seq, device)
    global_batch = workload.samples * world
    pool = masked_batch(torch.Generator().manual_seed(0), 8 * global_batch, seq, 8000, device)
    no_buffer_sync = {"forward_sync_buffers" if DDP_DEPRECATES_BROADCAST_BUFFERS else "broadcast_buffers": False}
    models = {}
    for kind in ("hsync", "fixed"):
        torch.manual_seed(0)
        models[kind] = hsync.WeightedDDP(workload.make_model(), **no_buffer_sync)
    torch.manual_seed(0)
    models["ddp"] = DistributedDataParallel(workload.make_model(), **no_buffer_sync)
    optimizers = {kind: torch.optim.SGD(model.parameters(), lr=1e-4) for kind, model in models.items()}
    balancer = hsync.Balancer(models["hsync"], len(pool[0]), hsync.BalanceConfig(global_batch_size=global_batch,
                                                                                **pace(quick)))

    def loss_of(model, indices) -> torch.Tensor:
        batch_of = tuple(t[indices] for t in pool)
        return sum(workload.loss(model, batch_of) for _ in range(repeats[rank])) / repeats[rank]

    def batches() -> Iterator[list[int]]:
        while True:
            yield from balancer

    hsync_batches = batches()
    cursor = 0
    split_log = SplitLog()

    def hsync_step() -> None:
        while True:
            if balancer.backward(loss_of(models["hsync"], next(hsync_batches))) is not None:
                break
        optimizers["hsync"].step()
        optimizers["hsync"].zero_grad()
        split_log.record(balancer)

    def fixed_step(shares: list[int], kind: str) -> None:
        nonlocal cursor
        start = (cursor + sum(shares[:rank])) % (len(pool[0]) - global_batch)
        cursor += global_batch
        loss = loss_of(models[kind], list(range(start, start + shares[rank])))
        if kind == "ddp":
            loss.backward()
        else:
            models[kind].backward(loss, weight=shares[rank])
        optimizers[kind].step()
        optimizers[kind].zero_grad()

    equal = [global_batch // 2, global_batch - global_batch // 2]
    sweep = sorted({n for n in range(global_batch // 2, global_batch - 1, max(1, global_batch // 16))})
    variants: dict[str, Callable[[], None]] = {"hsync": hsync_step, "ddp": partial(fixed_step, equal, "ddp")}
    variants |= {f"fixed-{n}": partial(fixed_step, [n, global_batch - n], "fixed") for n in sweep}

    while balancer.decisions < 2:  # warm-up, probes, the equal split measured: plans from here on
        hsync_step()
    split_log.splits.clear()
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant, step in variants.items():
            times[variant] += _timed(step, steps, device)
    med, p90 = slowest_rank_quantiles(times)
    oracle = min((v for v in med if v.startswith("fixed-")), key=lambda v: med[v])
    hs, dd = med["hsync"], med["ddp"]
    extra = {"hsync_samples_per_s": global_batch / hs, "ddp_samples_per_s": global_batch / dd,
             "oracle_samples_per_s": global_batch / med[oracle], "speedup_vs_ddp": dd / hs,
             "auto_vs_oracle": med[oracle] / hs, "oracle_rank0": float(oracle.removeprefix("fixed-"))}
    extra |= {f"{v}_samples_per_s": global_batch / med[v] for v in med if v.startswith("fixed-")}
    extra |= {f"plan_rank{r}": n for r, n in enumerate(balancer.last_plan)}
    extra["plan_changes"] = split_log.changes()
    # The fits a user reads (fitted_costs()) beside each rank's step timed alone at a sweep of shares, and the
    # attainable step those give.
    extra |= fitted_costs(balancer)
    torch.manual_seed(0)
    bare = workload.make_model()
    bare_optimizer = torch.optim.SGD(bare.parameters(), lr=1e-4)

    def step_alone(n: int) -> None:
        loss_of(bare, list(range(n))).backward()
        bare_optimizer.step()
        bare_optimizer.zero_grad()

    extra |= attainable(step_alone, global_batch, dd, hs, steps, device)
    for r in range(world):
        extra[f"fit_vs_alone_per_example_rank{r}"] = (extra[f"fitted_per_example_s_rank{r}"]
                                                      / extra[f"alone_per_example_s_rank{r}"])
    return Result(name, hs, dd, NAN, p90["hsync"], p90["ddp"], NAN, global_batch, extra=extra)


def _timed(step: Callable[[], None], count: int, device: torch.device) -> list[float]:
    """Seconds of each of `count` steps, after one untimed step that carries the switch from another
    variant's round; on a GPU each step's work is waited for, so that its time is the device's."""
    step()
    times, started = [], time.perf_counter()
    for _ in range(count):
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        times.append(now - started)
        started = now
    return times
