"""A communication hook of the user's on the NCCL path: two ranks on one GPU, the hook's all-reduce through
torch's NCCL group and hsync's flags through its own communicator (skipped without a GPU)."""

import pytest
import torch

from tests.distributed.test_comm_hooks import one_process, weighted_steps
from tests.gpu.test_nccl import SOCKET_ENV
from tests.spawn import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def on_gpu(rank: int, world_size: int, hook: str) -> list[torch.Tensor]:
    torch.cuda.set_device(0)
    return weighted_steps(rank, world_size, hook, False, True, "cuda")


@pytest.mark.parametrize("hook", ["allreduce", "bf16-wrapped"])
def test_weighted_steps_through_a_users_hook_over_nccl_equal_one_process(hook):
    expected = one_process(3)
    tolerance = dict(rtol=2e-2, atol=1e-2) if hook == "bf16-wrapped" else dict(rtol=1e-4, atol=1e-5)
    for params in run_ranks(on_gpu, 2, hook, backend="nccl", env=SOCKET_ENV, timeout=120):
        for ours, theirs in zip(params, expected, strict=True):
            torch.testing.assert_close(ours, theirs, **tolerance)
