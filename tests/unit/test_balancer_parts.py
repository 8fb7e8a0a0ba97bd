"""The Balancer's parts on their own: the step splitter, the reports' codec, the micro-batch memory model."""

from collections import Counter

import pytest

from hsync.balance.memory import MicroBatchMemory
from hsync.balance.planner import RankCost
from hsync.balance.reports import Report, ReportCodec
from hsync.balance.splitter import StepSplitter


def epoch(splitter: StepSplitter, models: list[RankCost], epoch: int = 0) -> list[list]:
    """Every rank's micro-batches of a whole epoch, as each rank's splitter cuts them."""
    return [[micro for split in splitter.steps(epoch, 0, 0, rank, lambda step: models, lockstep=False)
             for micro in split.micro_batches] for rank in range(len(models))]


def test_an_epoch_is_every_example_once_across_ranks_with_fillers_for_empty_shares():
    # 17 examples in steps of 8: the last step's one example leaves two ranks a filler each.
    costs = [float(1 + (7 * i) % 5) for i in range(17)]
    splitter = StepSplitter(costs, 8, 3, seed=4, shuffle=True, rank_batch_sizes=None)
    models = [RankCost(0.0, 1.0, micro_cap=6.0), RankCost(0.0, 2.0), RankCost(0.0, 4.0)]
    ranks = epoch(splitter, models)
    used = Counter(i for micro_batches in ranks for micro in micro_batches if not micro.filler for i in micro.indices)
    assert sorted(used) == list(range(17)) and set(used.values()) == {1}
    fillers = [m for micro_batches in ranks for m in micro_batches if m.filler]
    assert len(fillers) == 2 and all(m.step == 2 and m.last and m.examples == 0 for m in fillers), fillers
    for micro_batches in ranks:
        assert [m.step for m in micro_batches if m.last] == [0, 1, 2], "each rank ends every step once"
    capped = [m for m in ranks[0] if not m.filler]
    assert all(m.units <= 6.0 or m.examples == 1 for m in capped)
    assert all(m.units == m.examples * max(costs[i] for i in m.indices) for m in capped)


def test_the_same_seed_and_epoch_give_the_same_steps_and_another_epoch_another_order():
    splitter = StepSplitter([1.0] * 40, 16, 2, seed=1, shuffle=True, rank_batch_sizes=[11, 5])
    models = [RankCost(0.0, 1.0)] * 2
    again = StepSplitter([1.0] * 40, 16, 2, seed=1, shuffle=True, rank_batch_sizes=[11, 5])
    assert epoch(splitter, models) == epoch(again, models)
    assert splitter.order(0) != splitter.order(1)
    sizes = [split.sizes for split in splitter.steps(0, 0, 0, 0, lambda step: models, lockstep=False)]
    assert sizes == [[11, 5], [11, 5], [6, 2]], "the fixed split, and the last step's 8 by largest remainders"
    assert StepSplitter([1.0] * 5, 2, 2, seed=0, shuffle=False, rank_batch_sizes=None).order(3) == [0, 1, 2, 3, 4]


def test_drop_last_drops_an_epochs_short_last_step_and_draws_the_rest_from_every_example():
    splitter = StepSplitter([1.0] * 40, 16, 2, seed=1, shuffle=True, rank_batch_sizes=[11, 5], drop_last=True)
    models = [RankCost(0.0, 1.0)] * 2
    for e in range(2):
        steps = list(splitter.steps(e, 0, 0, 0, lambda step: models, lockstep=False))
        assert [split.sizes for split in steps] == [[11, 5], [11, 5]]
        used = Counter(i for rank in epoch(splitter, models, e) for micro in rank for i in micro.indices)
        assert set(used.values()) == {1} and sorted(used) == sorted(splitter.order(e)[:32])
    assert splitter.order(0)[32:] != splitter.order(1)[32:], "another epoch leaves out other examples"
    # A short step that is dropped cannot leave a rank without an example.
    dropping = StepSplitter([1.0] * 9, 4, 2, seed=0, shuffle=True, rank_batch_sizes=None, drop_last=True)
    dropping.check_epoch_end_lockstep()


def test_a_lockstep_split_that_leaves_a_rank_without_an_example_is_refused_before_training():
    with pytest.raises(ValueError, match="a step of size 1 would leave a rank without an example"):
        StepSplitter([1.0] * 9, 4, 2, seed=0, shuffle=True, rank_batch_sizes=None).check_epoch_end_lockstep()
    StepSplitter([1.0] * 10, 4, 2, seed=0, shuffle=True, rank_batch_sizes=None).check_epoch_end_lockstep()


def test_reports_survive_the_sum_over_ranks():
    codec = ReportCodec(3)
    reports = [Report(0.5, 12.0, 0.0, 4, 3, 0), Report(0.0, 0.0, 96.0, 5, 3, 1), Report(1.25, 7.0, 3.0, 0, 2, 0)]
    reduced = Counter()
    for rank, report in enumerate(reports):
        sent = codec.encode(rank, report)
        assert set(sent) <= set(codec.metric_names)
        reduced.update(sent)
    assert codec.decode({name: reduced[name] for name in codec.metric_names}) == reports
    assert len(codec.metric_names) == 6 * 3


class FakeDevice:
    """A device whose peaks are base + units * per_unit bytes, of `total` bytes."""

    def __init__(self, total: float, base: float, per_unit: float) -> None:
        self.total, self.base, self.per_unit, self.units = total, base, per_unit, 0.0

    def take_peak_bytes(self) -> int:
        return int(self.base + self.units * self.per_unit)

    def budget_bytes(self, fraction: float) -> float:
        return fraction * self.total


def test_micro_batch_memory_fits_the_peaks_grows_at_most_twofold_and_halves_what_ran_out():
    device = FakeDevice(total=1000.0, base=100.0, per_unit=10.0)
    memory = MicroBatchMemory(device, fraction=0.9)
    assert memory.capacity() == 0.0 and memory.may_run_out(1.0), "nothing measured: not known"
    for units in (4.0, 8.0, 8.0, 4.0, 8.0, 4.0):
        device.units = units
        memory.measure(units)
    assert memory.capacity() == pytest.approx(16.0), "at most twice the largest measured, below (900 - 100) / 10"
    assert not memory.may_run_out(8.0) and memory.may_run_out(9.0)
    memory.ran_out(12.0)
    assert memory.capacity() == pytest.approx(6.0), "half the micro-batch that ran out of memory"
