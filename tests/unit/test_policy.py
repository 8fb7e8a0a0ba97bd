"""The balancing policy against simulated clusters: decisions in milliseconds, no process spawned."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import numpy as np
import pytest

from hsync.balance.policy import Policy, PolicyConfig
from hsync.bench.cluster import SimulatedCluster, SimulatedRank, SpeedChange

EQUAL_64 = [1.0] * 64


def plain(value) -> bool:
    """Whether `value` is made of Python's own numbers, strings, None, lists and dicts only."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)


def changes_of(plans: list[list[int]]) -> list[tuple[int, list[int]]]:
    """(step, plan) wherever the plan differs from the step before."""
    return [(s, p) for s, p in enumerate(plans) if s == 0 or p != plans[s - 1]]


def test_a_rank_that_slows_down_is_followed_within_a_refit_period_and_never_undone():
    # Two ranks at 1 ms per example; rank 1 becomes 3x slower at step 60 (a GPU that throttles).
    cluster = SimulatedCluster([SimulatedRank(0.0, 1e-3, 0.01)] * 2, [SpeedChange(60, 1, 3.0)], seed=1)
    run, _ = cluster.run(PolicyConfig(2, replan_every=25), EQUAL_64, 200)
    adapted = next(s for s in range(60, 200) if run.plans[s] != [32, 32])
    assert adapted <= 60 + 25, changes_of(run.plans)
    assert all(abs(p[0] - 48) <= 1 for p in run.plans[adapted:]), changes_of(run.plans)  # 48 + 16 is optimal


def test_a_rank_that_speeds_up_again_is_followed_back():
    cluster = SimulatedCluster([SimulatedRank(0.0, 1e-3, 0.01)] * 2,
                               [SpeedChange(60, 1, 3.0), SpeedChange(140, 1, 1 / 3)], seed=2)
    run, _ = cluster.run(PolicyConfig(2, replan_every=25), EQUAL_64, 240)
    back = next(s for s in range(140, 240) if abs(run.plans[s][0] - 32) <= 1)
    assert back <= 140 + 25, changes_of(run.plans)
    assert all(abs(p[0] - 32) <= 1 for p in run.plans[back:]), changes_of(run.plans)


@pytest.mark.parametrize(("fixed", "noise"), [(0.0, 0.01), (0.01, 0.05), (0.05, 0.05), (0.01, 0.1)])
def test_equal_ranks_go_back_to_the_equal_split_after_a_transient_slowdown(fixed, noise):
    # Rank 1 runs at half speed for 30 steps (a neighbour's job, thermal throttling), then as before. The plan
    # follows it away and must come all the way back: models fitted around the uneven split still lean a little
    # its way, and a plan 1-5 examples off equal would otherwise stay, as no step from it promises more than noise.
    for seed in range(5):
        cluster = SimulatedCluster([SimulatedRank(fixed, 1e-3, noise)] * 2,
                                   [SpeedChange(60, 1, 2.0), SpeedChange(90, 1, 0.5)], seed=seed)
        run, _ = cluster.run(PolicyConfig(2), EQUAL_64, 300)
        assert any(p[0] > 36 for p in run.plans[60:90]), ("followed the slowdown", seed, changes_of(run.plans))
        assert all(p == [32, 32] for p in run.plans[150:]), (seed, changes_of(run.plans))


class EqualSplitContended(SimulatedCluster):
    """From step `since` on, the equal split makes both ranks' steps `factor` times as long (ranks on one machine
    whose equal shares contend for it): the equal split looks best to the models and measures worse."""

    def __init__(self, ranks, changes, since: int, factor: float, **kwargs) -> None:
        super().__init__(ranks, changes, **kwargs)
        self.since, self.factor = since, factor

    def busy(self, step, units):
        times = super().busy(step, units)
        return times * (self.factor if step >= self.since and units[0] == units[1] else 1.0)


def test_a_move_back_to_the_equal_split_that_measured_worse_is_not_tried_again():
    # The slowdown of the test above, after which the equal split contends: the one move back to it measures
    # slower than predicted, the plan it replaced comes back, and the plan then settles off equal, where steps are
    # fastest, instead of trying the equal split again at every decision.
    for seed in range(3):
        cluster = EqualSplitContended([SimulatedRank(0.01, 1e-3, 0.02)] * 2,
                                      [SpeedChange(60, 1, 2.0), SpeedChange(90, 1, 0.5)], since=95, factor=1.6,
                                      seed=seed)
        run, _ = cluster.run(PolicyConfig(2), EQUAL_64, 300)
        back_to_equal = [s for s, p in changes_of(run.plans) if s > 90 and p == [32, 32]]
        assert len(back_to_equal) <= 1, (seed, changes_of(run.plans))
        assert run.plans[-1] != [32, 32] and abs(run.plans[-1][0] - 32) <= 3, (seed, changes_of(run.plans))


def test_a_straggler_moves_nothing():
    # Equal ranks, and every fortieth step of rank 1 takes five times as long.
    cluster = SimulatedCluster([SimulatedRank(0.01, 1e-3, 0.02)] * 2, straggler_rate=1 / 40, straggler_factor=5.0,
                               seed=3)
    run, _ = cluster.run(PolicyConfig(2, replan_every=10), EQUAL_64, 300)
    assert sum(t > 2 * min(run.step_s) for t in run.step_s) >= 5, "stragglers happened"
    assert all(p == [32, 32] for p in run.plans[12:]), changes_of(run.plans)


@pytest.mark.parametrize("seed", range(5))
def test_a_fast_ranks_noisy_work_does_not_hold_back_a_slow_ranks_balancing(seed):
    # Rank 0's own work is tiny and very noisy (its relative spread is huge, as a loaded CPU's sub-millisecond
    # steps are); rank 1 takes 40x longer per example. Its noise is a few percent of the step: the plan must move.
    cluster = SimulatedCluster([SimulatedRank(0.0, 5e-4, 1.5), SimulatedRank(0.005, 0.02, 0.02)], seed=seed)
    run, _ = cluster.run(PolicyConfig(2, warmup_steps=1, probe_steps=1, replan_every=3), [1.0] * 12, 20)
    assert run.plans[-1][0] >= 10, changes_of(run.plans)


@pytest.mark.parametrize("seed", range(3))
def test_equal_ranks_keep_an_equal_split_under_noise(seed):
    cluster = SimulatedCluster([SimulatedRank(0.05, 0.01, 0.05)] * 2, seed=seed)
    run, _ = cluster.run(PolicyConfig(2, replan_every=10), EQUAL_64, 300)
    assert all(p == [32, 32] for p in run.plans[12:]), changes_of(run.plans)


class CheckpointWrites(SimulatedCluster):
    """Every `every` steps, every rank's step takes `factor` times as long (a checkpoint written)."""

    def __init__(self, ranks, every: int, factor: float, **kwargs) -> None:
        super().__init__(ranks, **kwargs)
        self.every, self.factor = every, factor

    def busy(self, step, units):
        times = super().busy(step, units)
        return times * self.factor if step % self.every == self.every - 1 else times


@pytest.mark.parametrize(("world", "noise"), [(2, 0.1), (2, 0.3), (4, 0.2), (8, 0.3)])
def test_equal_ranks_are_never_re_planned_under_noise_and_stalls(world, noise):
    # Every step of every rank off by a lognormal factor (sigma 0.1 to 0.3: a shared machine), a garbage
    # collection tripling one rank's step every 50 steps on average, a checkpoint quadrupling every
    # rank's step every 200: nothing here is a rank's speed, and nothing moves the equal split.
    for seed in range(3):
        cluster = CheckpointWrites([SimulatedRank(0.01, 1e-3, noise)] * world, every=200, factor=4.0,
                                   straggler_rate=1 / 50, straggler_factor=3.0, seed=seed)
        run, policy = cluster.run(PolicyConfig(world), [1.0] * 64, 1000)
        equal = [64 // world] * world
        assert policy.decisions >= 1000 // 25 - 2, "a decision every 25 steps (replan_every)"
        # From step 12 on, after the warm-up (2 steps) and the probes (3 x 3), the equal split is in force.
        assert changes_of(run.plans[12:]) == [(0, equal)], (seed, changes_of(run.plans))


class Replayed(SimulatedCluster):
    """Two ranks whose busy times are a real run's at the equal split, scaled by each rank's share of the step."""

    def __init__(self, busy_ms: list[list[float]], per_rank: float) -> None:
        super().__init__([SimulatedRank(0.0, 1.0 / per_rank)] * 2)
        self.busy_s, self.per_rank = np.asarray(busy_ms) / 1e3, per_rank

    def busy(self, step, units):
        return self.busy_s[step] * np.asarray(units) / self.per_rank


def test_on_two_equal_cpu_ranks_the_plan_costs_nothing_against_the_equal_split():
    # The BERT main job's busy times on the 2-core VM at the equal split, five runs (tests/data): one rank
    # was 0-12% slower than the other for a whole run, and for a few steps at a time the OS gives one rank
    # tens of per cent less of its core. Replayed through the policy, 400 steps from every 50th, the steps
    # under its plans take at most 2% longer than under the equal split in every stretch. The plan follows
    # slowdowns that last a few steps, as it must on a GPU, but not each step's noise: a policy that asks a move
    # to promise no more than min_gain, whatever the noise, moved 118 times in these stretches, this one 51.
    recorded = json.loads((Path(__file__).parents[1] / "data" / "bert-tiny-equal-split-busy.json").read_text())
    ratios, moves = [], []
    for busy_ms in recorded["busy_ms"]:
        for start in range(0, len(busy_ms) - 400 + 1, 50):
            run, _ = Replayed(busy_ms[start:start + 400], per_rank=16).run(PolicyConfig(2), [1.0] * 32, 400)
            ratios.append(sum(run.step_s[12:]) / sum(run.equal_s[12:]))  # after warm-up and probes
            moves.append(len(changes_of(run.plans[12:])) - 1)
    assert len(ratios) >= 10, "the recorded runs hold ten stretches of 400 steps or more"
    assert max(ratios) <= 1.02, [round(r, 3) for r in ratios]
    assert sum(moves) <= 4 * len(moves), moves


def test_the_plan_reaches_the_optimum_of_the_true_costs():
    # Rank 1 is twice as slow, and rank 0 pays a fixed 8 units more per step: the optimum balances
    # 0.08 + n0 / 100 against 2 * (0.01 + n1 / 100) with n0 + n1 = 64 (41 + 23 or 40 + 24: both 0.49 s).
    cluster = SimulatedCluster([SimulatedRank(0.08, 0.01, 0.02), SimulatedRank(0.01, 0.02, 0.02)], seed=4)
    run, _ = cluster.run(PolicyConfig(2, replan_every=10), EQUAL_64, 64)
    assert run.plans[12:22] == [[32, 32]] * 10, "the equal split is measured first"
    assert all(p in ([41, 23], [40, 24]) for p in run.plans[22:]), changes_of(run.plans)


class Contended(SimulatedCluster):
    """Ranks sharing cores: any unequal split makes both slower by `factor`, which no fit can foresee."""

    def __init__(self, factor: float, **kwargs) -> None:
        super().__init__([SimulatedRank(0.08, 0.01, 0.02), SimulatedRank(0.01, 0.02, 0.02)], **kwargs)
        self.factor = factor

    def busy(self, step, units):
        times = super().busy(step, units)
        return times * (self.factor if units[0] != units[1] else 1.0)


def test_a_plan_slower_than_predicted_is_re_measured_against_its_predecessor_and_undone():
    # Each retry must promise twice the gain of the one before, until none does.
    # The probes ran contended, so the models fitted on them overestimate the equal split's steps: measured,
    # those stray from them at once, and the models are fitted again on the equal split's own steps.
    run, _ = Contended(1.6, seed=5).run(PolicyConfig(2, replan_every=10), EQUAL_64, 120)
    assert run.plans[12] == [32, 32], changes_of(run.plans)
    moved = next(s for s in range(13, 120) if run.plans[s] != [32, 32])
    undone = next(s for s in range(moved, 120) if run.plans[s] == [32, 32])
    assert undone <= moved + 10, changes_of(run.plans)  # at the first decision after its first measured steps
    assert all(p == [32, 32] for p in run.plans[-10:]), changes_of(run.plans)


@pytest.mark.parametrize("seed", range(3))
def test_noisy_steps_stay_near_the_oracle_without_jumping(seed):
    # 20% noise on every step (a shared machine); rank 1 twice as slow.
    cluster = SimulatedCluster([SimulatedRank(0.001, 0.5e-3, 0.2), SimulatedRank(0.001, 1e-3, 0.2)], seed=seed)
    run, _ = cluster.run(PolicyConfig(2), EQUAL_64, 300)
    settled = run.plans[60:]
    # The optimum is 42.7 + 21.3; a plan re-measured against its predecessor (5 steps) may go back briefly.
    assert sum(36 <= p[0] <= 50 for p in settled) >= 0.95 * len(settled), changes_of(run.plans)
    assert len(changes_of(settled)) <= 12, changes_of(run.plans)
    assert mean(run.oracle_s[60:]) / mean(run.step_s[60:]) >= 0.95
    assert mean(run.equal_s[60:]) / mean(run.step_s[60:]) >= 1.25


def test_a_resumed_policy_goes_on_with_its_plan_and_fits_instead_of_probing():
    cluster = SimulatedCluster([SimulatedRank(0.0, 0.5e-3, 0.01), SimulatedRank(0.0, 1e-3, 0.01)], seed=6)
    config = PolicyConfig(2)
    first, policy = cluster.run(config, EQUAL_64, 82)
    state = policy.state_dict()
    assert plain(state), "a checkpoint of plain values: hsync refuses to load pickled objects (numpy scalars too)"
    resumed = Policy(config)
    resumed.load_state_dict(state, first_step=82)
    second, _ = cluster.run(config, EQUAL_64, 60, policy=resumed, first_step=82)
    assert second.plans[0] == first.plans[-1] != [32, 32]
    assert all(p == first.plans[-1] for p in second.plans), "no probe, no equal split again"


def test_a_policy_resumes_only_on_the_same_number_of_ranks():
    with pytest.raises(ValueError, match="2 ranks cannot go on with 3"):
        Policy(PolicyConfig(3)).load_state_dict(Policy(PolicyConfig(2)).state_dict(), first_step=0)


def test_many_ranks_of_mixed_speeds_come_within_five_percent_of_the_oracle():
    speeds = [1.0, 1.0, 0.5, 0.5, 0.33, 0.33, 0.25, 0.25] * 8  # 64 ranks of four kinds
    ranks = [SimulatedRank(0.002, 1e-3 / s, 0.03) for s in speeds]
    cluster = SimulatedCluster(ranks, seed=7)
    costs = [1.0] * (64 * 8)
    run, _ = cluster.run(PolicyConfig(64), costs, 120)
    assert mean(run.oracle_s[-40:]) / mean(run.step_s[-40:]) >= 0.95
    assert mean(run.equal_s[-40:]) / mean(run.step_s[-40:]) > 1.5
