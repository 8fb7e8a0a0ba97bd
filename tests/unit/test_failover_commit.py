"""FaultTolerantSteps asks torchft to commit a step only once its reductions are known to have completed. On a
GPU they run on after backward returns, and one that a lost replica failed is raised where the step's stats are
read: that must happen before torchft's commit, or the step commits on partly reduced gradients and the error
is raised in the loop, outside the retry. Here the step's stats raise as such a GPU step's do; the collectives
themselves are the distributed tests' (tests/distributed/test_failover.py, tests/gpu/test_failover_cuda.py)."""

import pytest
import torch

pytest.importorskip("torchft", reason="hsync[torchft] is not installed")


class LostReplica(RuntimeError):
    pass


class FailedWhenRead:
    """A step's stats whose reductions a lost replica failed: reading them raises, as StepStats.finite does."""

    @property
    def finite(self) -> bool:
        raise LostReplica("hsync: reduce of bucket 0 failed: a peer exited")


class Completed:
    finite = True


class OneStepBalancer:
    filler = False

    def __init__(self, stats: object) -> None:
        self.stats = stats

    def steps(self):
        yield [[0, 1], [2]]

    def forward_backward(self, indices: list[int], loss_of) -> object:
        loss_of(indices)
        return self.stats

    def state_dict(self) -> dict:
        return {"epoch": 0, "global_step": 1, "step_in_epoch": 1}


class Manager:
    """torchft's Manager as FaultTolerantSteps uses it: a step commits unless an error was reported in it."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self.decisions: list[bool] = []
        self._errored = False

    def start_quorum(self) -> None:
        self._errored = False

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)
        self._errored = True

    def should_commit(self) -> bool:
        self.decisions.append(not self._errored)
        return not self._errored


def test_a_reduction_that_fails_after_backward_returns_is_reported_before_the_commit():
    from hsync.fault_tolerance import FaultTolerantSteps

    steps = object.__new__(FaultTolerantSteps)  # its parts, without torchft's Lighthouse and a quorum
    module = torch.nn.Linear(2, 1)
    steps.optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    steps.manager = Manager()
    steps.model, steps._position, steps._epoch, steps._replica_id = None, None, 0, "replica"
    steps.examples_in_step, steps._state, steps._in_job = [], {}, False
    steps._quorum = type("Quorum", (), {"pending": None})()
    steps.balancer = OneStepBalancer(FailedWhenRead())
    regroups = []

    def regroup() -> None:  # the new quorum's group: this time the step's reductions complete
        regroups.append(True)
        steps.balancer = OneStepBalancer(Completed())

    steps._regroup = regroup
    steps._lost_a_peer = lambda error: isinstance(error, LostReplica)
    ran = []

    stats = steps.step(lambda indices: ran.append(indices))

    assert steps.manager.decisions == [False, True], "the failed attempt must not commit; its rerun does"
    assert [str(e) for e in steps.manager.errors] == ["hsync: reduce of bucket 0 failed: a peer exited"]
    assert regroups == [True] and ran == [[0, 1], [2], [0, 1], [2]], (regroups, ran)
    assert stats.finite and steps.global_step == 1
