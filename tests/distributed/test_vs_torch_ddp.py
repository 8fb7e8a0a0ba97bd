"""A plain loss.backward() through WeightedDDP gives torch DDP's gradients, step by step."""

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.workloads import TINY_BUCKET_MB, global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]


def train_both(rank: int, world_size: int, micro_steps: int, views: bool) -> list[float]:
    """Trains hsync and torch DDP side by side on equal batches; returns the largest gradient gap per step."""
    import hsync

    ours = hsync.WeightedDDP(make_net(seed=rank), bucket_cap_mb=TINY_BUCKET_MB, first_bucket_cap_mb=TINY_BUCKET_MB,
                             gradient_as_bucket_view=views)
    theirs = DistributedDataParallel(make_net(seed=rank), bucket_cap_mb=TINY_BUCKET_MB, find_unused_parameters=True,
                                     gradient_as_bucket_view=views)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    gaps = []
    for step in range(3):
        for micro in range(micro_steps):
            _, _, slices = global_batch(step, [4] * world_size, micro)
            x, y = slices[rank]
            last = micro == micro_steps - 1
            for model in (ours, theirs):
                with contextlib.nullcontext() if last else model.no_sync():
                    mse(model(x, use_branch=rank == 1), y).backward()
        gap = 0.0
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), f"{name}: one has a gradient, the other not"
            if a.grad is not None:
                gap = max(gap, (a.grad - b.grad).abs().max().item())
        gaps.append(gap)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return gaps


@pytest.mark.parametrize("views", [False, True], ids=["copied", "bucket-views"])
@pytest.mark.parametrize("micro_steps", [1, 3], ids=["synced", "no_sync"])
def test_plain_backward_gives_torch_ddp_gradients(micro_steps, views):
    for rank, gaps in enumerate(run_ranks(train_both, 2, micro_steps, views)):
        assert max(gaps) < 1e-12, f"rank {rank}: gradients differ from torch DDP by {gaps}"
