"""gradient_as_bucket_view: every gradient lives in its bucket, so the engine keeps no second copy."""

import pytest
import torch

from tests.distributed.workloads import TINY_BUCKET_MB, global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]


def gradient_storages(rank: int, world_size: int, set_to_none: bool) -> list[dict]:
    """Per step: which storage each parameter's gradient lives in, and the bucket assignment."""
    import hsync

    # Buckets of about 300 bytes: several of them, some holding several parameters.
    cap_mb = 3 * TINY_BUCKET_MB
    model = hsync.WeightedDDP(make_net(seed=0), bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb,
                              gradient_as_bucket_view=True)
    params = [p for p in model.module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    steps = []
    for step in range(4):
        _, _, slices = global_batch(step, [3, 5][:world_size])
        x, y = slices[rank]
        model.backward(mse(model(x, use_branch=True), y), weight=len(x))
        steps.append({"storage": [None if p.grad is None else p.grad.untyped_storage().data_ptr() for p in params],
                      "buckets": model.bucket_params})
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return steps


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_into_their_bucket(set_to_none):
    for rank, steps in enumerate(run_ranks(gradient_storages, 2, set_to_none)):
        for index, step in enumerate(steps):
            storage, buckets = step["storage"], step["buckets"]
            assert len(buckets) >= 3, "the small cap should give several buckets"
            shared = [[storage[i] for i in bucket if storage[i] is not None] for bucket in buckets]
            used = [set(s) for s in shared if s]
            assert max(len(s) for s in shared) >= 2, "no bucket holds two gradients: the check below shows nothing"
            assert all(len(s) == 1 for s in used), f"rank {rank}, step {index}: a bucket's gradients are not one buffer"
            assert len({next(iter(s)) for s in used}) == len(used), f"rank {rank}, step {index}: buckets share a buffer"
        # From the second step on the buckets are final: the gradients stay in the same buffers.
        assert steps[1]["storage"] == steps[-1]["storage"], f"rank {rank}: gradients moved after the rebuild"
