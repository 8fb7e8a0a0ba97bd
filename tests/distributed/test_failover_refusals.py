"""What hsync.fault_tolerance refuses before it joins a job, in one line: a bad setting, a replica group of
several ranks, a process group of the program's own, a ShardedOptimizer, no Lighthouse."""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.spawn import run_ranks

pytest.importorskip("torchft", reason="hsync[torchft] is not installed")


@pytest.mark.parametrize(("settings", "message"), [
    ({"min_replicas": 0}, "min_replicas must be a positive integer, got 0"),
    ({"max_retries": -1}, "max_retries must be None or a non-negative integer, got -1"),
    ({"timeout": datetime.timedelta(seconds=-1)}, "the collective timeout must be positive and finite"),
    ({"quorum_timeout": datetime.timedelta(0)}, "quorum_timeout must be positive"),
], ids=["min-replicas", "max-retries", "timeout", "quorum-timeout"])
def test_a_bad_setting_is_refused_where_it_is_made(settings, message):
    from hsync.fault_tolerance import FaultToleranceConfig

    with pytest.raises(ValueError, match=message):
        FaultToleranceConfig(**settings)


def steps_for(optimizer_of=None, **config):
    import hsync
    from hsync.fault_tolerance import FaultToleranceConfig, FaultTolerantSteps

    module = nn.Linear(2, 2)
    optimizer = (optimizer_of or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))(module)
    return FaultTolerantSteps(module, optimizer, 8, hsync.BalanceConfig(global_batch_size=4),
                              FaultToleranceConfig(**config))


def test_a_replica_group_of_several_ranks_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"each replica group is one rank .* not 2 ranks in one"):
        steps_for(lighthouse="http://localhost:1")


def test_no_lighthouse_is_refused(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="no Lighthouse: pass FaultToleranceConfig"):
        steps_for()


def refusals_in_a_process_group(rank: int, world_size: int) -> list[str]:
    import hsync

    errors = []
    try:  # the program's own process group
        steps_for(lighthouse="http://localhost:1")
    except RuntimeError as error:
        errors.append(str(error))
    sharded = hsync.ShardedOptimizer(hsync.WeightedDDP(nn.Linear(2, 2)), torch.optim.SGD, lr=0.1)
    dist.destroy_process_group()
    try:
        steps_for(lambda module: sharded, lighthouse="http://localhost:1")
    except ValueError as error:
        errors.append(str(error))
    return errors


@pytest.mark.distributed
def test_a_process_group_of_the_programs_own_and_a_sharded_optimizer_are_refused():
    [errors] = run_ranks(refusals_in_a_process_group, 1, timeout=60)
    assert len(errors) == 2, errors
    assert "builds the process group of each quorum itself" in errors[0]
    assert "a ShardedOptimizer keeps each shard of the optimizer state on one rank only" in errors[1]
