"""A communication hook of the user's on the NCCL path: two ranks on one GPU, the hook's all-reduce through
torch's NCCL group and hsync's flags through its own communicator (skipped without a GPU)."""

import pytest
import torch

from tests.distributed.test_comm_hooks import hooked_steps_in_any_timing, one_process, weighted_steps
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


def test_powersgd_over_nccl_keeps_one_order_of_collectives():
    # On NCCL a hook's future completes as its work is queued: the chain runs on the thread that submits each
    # bucket (Note [Hook order]); every rank ends with the same parameters, the fingerprints agreeing throughout.
    results = run_ranks(hooked_steps_in_any_timing, 2, "powersgd", 12, "cuda", backend="nccl",
                        env={**SOCKET_ENV, "HSYNC_DEBUG_COLLECTIVES": "1"}, timeout=120)
    assert results[0][1] >= 4, results[0][1]
    for ours, theirs in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
