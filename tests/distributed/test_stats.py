"""The fused per-step scalars: global loss, weight, metrics and the non-finite flag."""

import math

import pytest
import torch

from tests.distributed.workloads import global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]

SIZES = [3, 5, 0]


def step_stats(rank: int, world_size: int):
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0), metric_names=("correct", "seen"))
    x_all, y_all, slices = global_batch(0, SIZES)
    x, y = slices[rank] if SIZES[rank] else (x_all[:1], y_all[:1])
    loss = mse(model(x), y)
    stats = model.backward(loss, weight=SIZES[rank], metrics={"correct": rank + 1.0, "seen": torch.tensor(2.0)})
    clean = (stats.loss, stats.weight, stats.metrics, stats.finite, loss.item())
    model.module.zero_grad()

    # A NaN in one rank's gradient (here the rank with weight 0) flags the step on every rank.
    nan_rank = 2
    hook = model.module.out.weight.register_hook(lambda g: torch.full_like(g, math.nan)) if rank == nan_rank else None
    stats = model.backward(mse(model(x), y), weight=SIZES[rank])
    if hook:
        hook.remove()
    grad_nan = stats.finite
    model.module.zero_grad()

    # A non-finite loss on one rank flags the step too.
    loss = mse(model(x), y) * (math.inf if rank == 0 else 1.0)
    loss_inf = model.backward(loss, weight=SIZES[rank]).finite
    return clean, grad_nan, loss_inf


def test_stats_are_global_and_flags_reach_every_rank():
    results = run_ranks(step_stats, 3)
    local_losses = [r[0][4] for r in results]
    expected_loss = sum(n * loss for n, loss in zip(SIZES, local_losses, strict=True)) / sum(SIZES)
    for rank, (clean, grad_nan, loss_inf) in enumerate(results):
        loss, weight, metrics, finite, _ = clean
        assert weight == sum(SIZES)
        assert loss == pytest.approx(expected_loss, rel=1e-12)
        assert metrics == {"correct": 6.0, "seen": 6.0}
        assert finite
        assert not grad_nan, f"rank {rank} missed a NaN gradient on the rank with weight 0"
        assert not loss_inf, f"rank {rank} missed an infinite loss on rank 0"
