"""The integrations with the frameworks people train with, each run on real ranks."""

import os
from collections.abc import Callable

import torch

# A launch's environment, as torchrun sets it for two ranks (the process group already runs: never dialled).
LAUNCH_ENV = {"RANK": "{rank}", "LOCAL_RANK": "{rank}", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def alone(rank: int, world_size: int, train: Callable, *args) -> dict:
    """train(rank, world_size, *args) as `python train.py` runs it: no launcher's environment, no process
    group. For tests.spawn.run_ranks with one rank."""
    torch.distributed.destroy_process_group()
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    return train(rank, world_size, *args)


def assert_near_float32(params: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                        start: dict[str, torch.Tensor]) -> None:
    """`params`, of a run whose forwards ran in 16 bits, are float32 and lie within what that rounding allows of
    `exact`, a float32 run's: less than 2% of the distance `exact` moved from `start` (measured: about 0.2%)."""
    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return float(sum((a[name].detach().float() - b[name].detach().float()).norm() ** 2 for name in start) ** 0.5)

    assert all(value.dtype == torch.float32 for value in params.values())  # only the forward is 16-bit
    assert distance(params, exact) < 0.02 * distance(exact, start)
