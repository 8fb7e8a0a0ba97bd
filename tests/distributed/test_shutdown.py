"""Models still alive when the process group is destroyed and the interpreter exits.

Holding the group strongly kept its gloo threads running into interpreter shutdown, where one of
them could abort the process (about one exit in three on two cores): the ranks must exit cleanly.
"""

import pytest
import torch
from torch import nn

from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

_kept_until_exit: list = []


def train_and_keep(rank: int, world_size: int) -> int:
    import hsync

    for _ in range(4):
        model = hsync.WeightedDDP(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
        for _ in range(3):
            model.backward(model(torch.randn(4, 32)).sum(), weight=4)
        _kept_until_exit.append(model)
    return len(_kept_until_exit)


def test_processes_exit_cleanly_with_models_alive():
    for _ in range(5):
        assert run_ranks(train_and_keep, 2) == [4, 4]
