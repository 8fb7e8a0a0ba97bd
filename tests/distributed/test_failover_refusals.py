"""What hsync.fault_tolerance refuses before it joins a job, in one line: a bad setting, a replica group of
several ranks, a process group of the program's own, a ShardedOptimizer, an LR scheduler it would not heal, no
Lighthouse or one that does not answer; and the state of another model, where a joining replica is healed."""

import datetime
import logging
import socket
import time

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


def steps_for(optimizer_of=None, state=None, **config):
    import hsync
    from hsync.fault_tolerance import FaultToleranceConfig, FaultTolerantSteps

    module = nn.Linear(2, 2)
    optimizer = (optimizer_of or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))(module)
    return FaultTolerantSteps(module, optimizer, 8, hsync.BalanceConfig(global_batch_size=4),
                              FaultToleranceConfig(**config), state=state)


def test_an_lr_scheduler_left_out_of_the_healed_state_is_refused():
    # A replica that joined restarted its schedule: it stepped at another rate than its peers, silently.
    def scheduled(module):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        return optimizer

    with pytest.raises(ValueError, match=r"an LR scheduler steps this optimizer, but is not in "
                                         r"FaultTolerantSteps\(state=...\)"):
        steps_for(scheduled, lighthouse="http://localhost:1")
    with pytest.raises(ValueError, match=r"state\['step'\] has no state_dict\(\) and load_state_dict\(\)"):
        steps_for(lighthouse="http://localhost:1", state={"step": 3})


def test_a_replica_healed_with_another_models_state_says_so():
    from types import SimpleNamespace

    from hsync.fault_tolerance import FaultTolerantSteps

    def replica(width: int) -> SimpleNamespace:
        module = nn.Linear(2, width)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        return SimpleNamespace(module=module, optimizer=optimizer, _state={"schedule": schedule}, _replica_id="g2",
                               _position=None)

    live, wider = replica(2), replica(3)
    given = FaultTolerantSteps._state_dict(live)
    with pytest.raises(ValueError, match=r"replica g2 cannot take the state it was given \(another model or optimizer "
                                         r"than the job's\?\): Error\(s\) in loading state_dict .*size mismatch"):
        FaultTolerantSteps._load_state_dict(wider, given)
    with pytest.raises(ValueError, match=r"replica g2 holds state \['schedule'\], the state it was given holds \[\]"):
        FaultTolerantSteps._load_state_dict(replica(2), {**given, "state": {}})


def test_a_replica_group_of_several_ranks_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"each replica group is one rank .* not 2 ranks in one"):
        steps_for(lighthouse="http://localhost:1")


def test_no_lighthouse_is_refused(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="no Lighthouse: pass FaultToleranceConfig"):
        steps_for()


@pytest.mark.parametrize("address", ["localhost:29510", "http://", "ftp://localhost:29510",
                                     "http://localhost:99999", "http://localhost:port"])
@pytest.mark.parametrize("source", ["FaultToleranceConfig.lighthouse", "TORCHFT_LIGHTHOUSE"])
def test_a_lighthouse_address_that_is_not_an_http_url_is_refused_at_once(monkeypatch, address, source):
    # torchft's client took each of these for a Lighthouse that does not answer, and said so at the deadline.
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"{source} must be the Lighthouse's address, http://host:port, "
                                         f"got '{address}'"):
        steps_for(**({"lighthouse": address} if source.startswith("FaultToleranceConfig") else {}))
    assert time.monotonic() - start < 5


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_lighthouse_that_does_not_answer_is_named_at_the_deadline_and_waited_for_aloud(monkeypatch, caplog):
    import hsync.fault_tolerance

    monkeypatch.setattr(hsync.fault_tolerance, "LIGHTHOUSE_PATIENCE", datetime.timedelta(seconds=0.5))
    address = f"http://localhost:{closed_port()}"
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(
            TimeoutError, match=rf"replica g0: no Lighthouse answered at {address} \(FaultToleranceConfig.lighthouse\) "
                                r"within the deadline of 2 s: .*refused"):
        steps_for(lighthouse=address, replica_id="g0", timeout=datetime.timedelta(seconds=2))
    assert 2 <= time.monotonic() - start < 6
    waiting = [r.getMessage() for r in caplog.records if "waiting for the Lighthouse" in r.getMessage()]
    assert len(waiting) == 1 and address in waiting[0] and "giving up after 2 s" in waiting[0], caplog.text


def test_under_check_only_the_settings_are_checked_and_the_program_ends_before_it_joins(monkeypatch):
    monkeypatch.setenv("HSYNC_CHECK_ONLY", "1")
    with pytest.raises(ValueError, match="must be the Lighthouse's address"):
        steps_for(lighthouse="localhost:1")
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:  # nothing answers there: it did not try to connect
        steps_for(lighthouse=f"http://localhost:{closed_port()}", timeout=datetime.timedelta(seconds=30))
    assert stopped.value.code == 0 and time.monotonic() - start < 5


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


@pytest.mark.parametrize("lighthouse_lost", [False, True], ids=["a-group-missing", "the-lighthouse-lost"])
def test_a_quorum_that_does_not_form_is_named_at_the_quorum_timeout(lighthouse_lost):
    # The Lighthouse waits for two replica groups, and one alone joins (the other lost before its first step), or the
    # Lighthouse itself is lost: torchft said only "Timeout expired", after 5 minutes by default, and hsync blamed
    # both on a group that had not joined.
    import subprocess

    from hsync.fault_tolerance import lighthouse_command

    port = closed_port()
    lighthouse = subprocess.Popen(lighthouse_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    why = (rf"the Lighthouse at http://localhost:{port} \(FaultToleranceConfig.lighthouse\) does not answer .*: the "
           r"job cannot go on without it; start it again from the job's checkpoint" if lighthouse_lost else
           r"fewer replica groups than the Lighthouse's --min_replicas have joined")
    try:
        steps = steps_for(lighthouse=f"http://localhost:{port}", replica_id="g0",
                          quorum_timeout=datetime.timedelta(seconds=2))
        if lighthouse_lost:
            lighthouse.kill()
        start = time.monotonic()
        with steps, pytest.raises(TimeoutError, match=(
                r"^hsync.fault_tolerance: replica g0: no quorum formed within the quorum timeout of 2 s "
                rf"\(FaultToleranceConfig.quorum_timeout\): {why}.* torchft: ")):
            steps.step(lambda indices: steps.model(torch.zeros(len(indices), 2)).sum())
        assert time.monotonic() - start < 10
    finally:
        lighthouse.kill()
        lighthouse.wait()
