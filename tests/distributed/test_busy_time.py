"""StepStats.busy_seconds counts a rank's own work, not its waits for a slower peer (Note [Busy time])."""

import time

import pytest
import torch
from torch import nn

from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

SLEEP_S = 0.4
STEPS = 6

# (the slow rank, where it sleeps, gradients as bucket views, a ShardedOptimizer): where the fast rank waits for it.
CASES = {
    # for rank 0's buffers, in its forward's broadcast
    "buffers-from-a-slow-root": (0, "before-forward", False, False),
    # for the step's total weight, at its first gradient (on the CPU only with bucket views)
    "total-weight-after-a-slow-forward": (1, "before-backward", True, False),
    # on the CPU, nowhere before its backward ends; on a GPU, for the total weight
    "a-slow-rank-before-its-forward": (1, "before-forward", False, False),
    # for an earlier bucket's reduce to its owner, whose buffer the next bucket needs (one bucket a parameter; 3
    # ranks, as gloo's reduce over 2 may complete a sender's part before its peer takes part)
    "reduces-to-owners-after-a-slow-forward": (2, "before-backward", False, True),
}


def busy_times(rank: int, world_size: int, device: str, slow_rank: int, sleep_at: str, views: bool,
               sharded: bool):
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    # BatchNorm's running statistics are buffers, broadcast from rank 0 before every forward.
    # Sharded, deeper: the fast rank's backward then has more of its peer's buckets than in-flight buffers.
    hidden = [layer for _ in range(6 if sharded else 0) for layer in (nn.Linear(64, 64), nn.Tanh())]
    net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Tanh(), *hidden, nn.Linear(64, 1)).to(device)
    caps = {"bucket_cap_mb": 1e-3, "first_bucket_cap_mb": 1e-3} if sharded else {}  # a bucket or two a layer
    model = hsync.WeightedDDP(net, gradient_as_bucket_view=views, **caps)
    if sharded:
        optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 16, device=device), torch.randn(32, 1, device=device)
    busy = []
    for _ in range(STEPS):
        if rank == slow_rank and sleep_at == "before-forward":
            time.sleep(SLEEP_S)
        loss = nn.functional.mse_loss(model(x), y)
        if rank == slow_rank and sleep_at == "before-backward":
            time.sleep(SLEEP_S)
        stats = model.backward(loss, weight=len(x))
        optimizer.step()
        optimizer.zero_grad(set_to_none=not views)
        busy.append(stats.busy_seconds)
    return busy


def check_busy_times(results: list[list[float | None]], slow_rank: int) -> None:
    for rank, busy in enumerate(results):
        assert busy[0] is None, "a rank's first weighted step has no previous step to count from"
        measured = busy[1:]
        if rank == slow_rank:
            # Its sleep is its own time: it lies between its previous step's end and its backward.
            assert min(measured) >= 0.95 * SLEEP_S, f"the slow rank's busy times {measured}"
        else:
            # Its own work takes milliseconds; the peer's sleep, had it been counted, SLEEP_S. Every step:
            # on a GPU the first measured one once counted it (Note [A host that blocks] in csrc/busy_clock.h).
            assert max(measured) < SLEEP_S / 2, (
                f"the fast rank's busy times {measured} count its waits for the slow rank ({SLEEP_S} s)")


@pytest.mark.parametrize("debug", [False, True], ids=["", "debug-collectives"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_fast_rank_does_not_count_its_waits_for_a_slow_one(case, debug):
    # In debug mode each collective begins with a host wait for every rank's fingerprint of it.
    slow_rank, sleep_at, views, sharded = CASES[case]
    env = {"HSYNC_DEBUG_COLLECTIVES": "1"} if debug else None
    results = run_ranks(busy_times, max(2, slow_rank + 1), "cpu", slow_rank, sleep_at, views, sharded, env=env)
    check_busy_times(results, slow_rank)


def with_a_collective_of_the_loops_own(rank: int, world_size: int, bracketed: bool) -> list[float | None]:
    import contextlib

    import hsync

    model = hsync.WeightedDDP(nn.Linear(4, 1))
    x, busy = torch.randn(8, 4), []
    for _ in range(3):
        if rank == 1:
            time.sleep(SLEEP_S)
        # A metric's all-reduce between steps, where rank 0 waits for rank 1.
        with model.waiting_for_peers() if bracketed else contextlib.nullcontext():
            torch.distributed.all_reduce(torch.ones(1))
        busy.append(model.backward(model(x).square().mean(), weight=len(x)).busy_seconds)
    return busy


def test_a_collective_of_the_loops_own_bracketed_is_a_wait_for_peers():
    bracketed = run_ranks(with_a_collective_of_the_loops_own, 2, True)
    check_busy_times(bracketed, slow_rank=1)
    # Unbracketed, the fast rank's wait there is its own time as far as the clock can tell.
    fast, _ = run_ranks(with_a_collective_of_the_loops_own, 2, False)
    assert min(fast[1:]) >= 0.9 * SLEEP_S, fast


def busy_so_far(rank: int, world_size: int) -> tuple[float | None, float, float]:
    import hsync
    from hsync.ddp import BalancedSteps

    model = hsync.WeightedDDP(nn.Linear(4, 1))
    steps = BalancedSteps(model)
    before_any_step = steps.busy_seconds_so_far()
    x = torch.randn(8, 4)
    model.backward(model(x).square().mean(), weight=len(x))
    time.sleep(0.2)
    so_far = steps.busy_seconds_so_far()
    stats = model.backward(model(x).square().mean(), weight=len(x))
    return before_any_step, so_far, stats.busy_seconds


def test_the_running_interval_reads_without_ending_it():
    # What a simulated slowdown on a GPU scales (hsync/balance/simulate.py): the rank's own time so far.
    for before_any_step, so_far, busy in run_ranks(busy_so_far, 2):
        assert before_any_step is None
        assert 0.2 <= so_far <= busy, (so_far, busy)
