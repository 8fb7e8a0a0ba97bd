"""Balancing two ranks that share one GPU, one slowed 2x: the plan, and the fast rank's busy time (skipped
without a GPU).

A step's cost is known by construction: preparing a micro-batch takes PER_EXAMPLE_S of host time per
example (as a data pipeline's), and the model's kernels are small, so that the two ranks' work hardly
contends for the shared GPU. Each rank's busy time is read off CUDA events (Note [Busy time]), with its
waits for the other rank on the stream left out: the fast rank's must match its time alone.
"""

import statistics
import time

import pytest
import torch
from torch import nn

from tests.gpu import note
from tests.gpu.test_nccl import SOCKET_ENV
from tests.spawn import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GLOBAL_BATCH = 48
PER_EXAMPLE_S = 0.001
SLOWDOWN = 2.0  # rank 1's
STEPS = 40


def prepare(data: torch.Tensor, target: torch.Tensor, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(PER_EXAMPLE_S * len(indices))
    return data[indices], target[indices]


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)


def time_alone(device: torch.device, data: torch.Tensor, target: torch.Tensor, examples: int,
               steps: int = 8) -> float:
    """Median seconds of a step of `examples` on the bare model, timed as busy_seconds is: from the end of
    one step's backward to the end of the next one's, its optimizer step included, on the device's
    timeline."""
    net = make_model(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    times, previous = [], None
    for _ in range(steps + 1):
        x, y = prepare(data, target, list(range(examples)))
        nn.functional.mse_loss(net(x), y).backward()
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        if previous is not None:
            done.synchronize()
            times.append(previous.elapsed_time(done) / 1e3)
        previous = done
        optimizer.step()
        optimizer.zero_grad()
    return statistics.median(times)


def balance_on_one_gpu(rank: int, world_size: int, device: str = "cuda") -> dict:
    import torch.distributed as dist

    import hsync
    from hsync.balance.simulate import SimulatedSlowdown

    device = torch.device(device, 0)
    torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(1)
    data, target = torch.randn(GLOBAL_BATCH * 10, 32, generator=g), torch.randn(GLOBAL_BATCH * 10, 1, generator=g)
    data, target = data.to(device), target.to(device)
    model = hsync.WeightedDDP(make_model(device))
    config = hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH, probe_steps=2, replan_every=6)
    balancer = hsync.Balancer(model, len(data), config, clock=SimulatedSlowdown(SLOWDOWN if rank == 1 else 1.0, device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []  # (this rank's examples, its busy seconds) per step
    while len(steps) < STEPS:
        for indices in balancer:
            x, y = prepare(data, target, indices)
            stats = balancer.backward(nn.functional.mse_loss(model(x), y))
            if stats is None:
                continue
            optimizer.step()
            optimizer.zero_grad()
            steps.append((balancer.last_plan[rank], stats.busy_seconds))
            if len(steps) == STEPS:
                break
    plan = balancer.planned_split()
    # Alone: rank 0 times its steps while rank 1 waits, at two sizes for the ideal split and at its share.
    alone = {}
    if rank == 0:
        alone = {n: time_alone(device, data, target, n) for n in sorted({16, 32, plan[0]})}
    dist.barrier()
    return {"steps": steps, "plan": plan, "alone": alone}


def test_the_plan_and_the_fast_ranks_busy_time_on_one_shared_gpu():
    from hsync.balance.planner import RankCost, fit_affine, split_step

    fast, slow = run_ranks(balance_on_one_gpu, 2, env=SOCKET_ENV, timeout=150)
    alone = fast["alone"]
    fixed, per_example = fit_affine([(n, alone[n], 1.0) for n in (16, 32)])
    # The slow rank runs the same work, SLOWDOWN times longer.
    ideal = split_step([1.0] * GLOBAL_BATCH, [RankCost(fixed, per_example), RankCost(SLOWDOWN * fixed,
                                                                                     SLOWDOWN * per_example)])
    ideal_fast = len(ideal[0])
    planned_fast = fast["plan"][0]
    in_force = [busy for examples, busy in fast["steps"][-10:] if examples == planned_fast]
    busy = statistics.median(in_force) if in_force else float("nan")
    summary = (f"plan {fast['plan']} against the ideal [{ideal_fast}, {GLOBAL_BATCH - ideal_fast}] (alone: "
               f"{fixed * 1e3:.2f} ms + {per_example * 1e3:.3f} ms/example); the fast rank's busy time at "
               f"{planned_fast} examples {busy * 1e3:.2f} ms against {alone[planned_fast] * 1e3:.2f} ms alone")
    note(f"balancing, 2 ranks on one GPU, rank 1 slowed {SLOWDOWN:g}x: {summary}")
    assert abs(planned_fast - ideal_fast) <= 0.1 * ideal_fast, summary
    assert abs(busy / alone[planned_fast] - 1) <= 0.1, summary
