"""The planner against brute force: the shortest step over every split of small cases."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hsync.balance.planner import (
    RankCost,
    fit_affine,
    micro_batches,
    padded_units,
    split_proportionally,
    split_step,
    split_time,
    step_time,
)


def all_count_splits(total: int, ranks: int, least: int):
    if ranks == 1:
        if total >= least:
            yield (total,)
        return
    for n in range(least, total - least * (ranks - 1) + 1):
        for rest in all_count_splits(total - n, ranks - 1, least):
            yield (n, *rest)


def random_ranks(rng: random.Random, world: int, caps: bool) -> list[RankCost]:
    return [RankCost(rng.choice([0.0, rng.uniform(0, 2)]), rng.uniform(0.1, 3),
                     rng.choice([math.inf, rng.randint(1, 6)]) if caps else math.inf) for _ in range(world)]


@pytest.mark.parametrize("seed", range(60))
def test_equal_examples_split_is_optimal_over_every_split(seed):
    rng = random.Random(seed)
    world, total = rng.randint(1, 4), rng.randint(1, 14)
    ranks = random_ranks(rng, world, caps=seed % 2 == 0)
    costs = [1.0] * total
    shares = split_step(costs, ranks)
    assert sorted(i for share in shares for i in share) == list(range(total)), "each example once"
    least = 1 if total >= world else 0
    assert all(len(share) >= least for share in shares)
    best = min(step_time(costs, [list(range(sum(split[:r]), sum(split[:r + 1]))) for r in range(world)], ranks)
               for split in all_count_splits(total, world, least))
    assert step_time(costs, shares, ranks) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_lengths_split_is_optimal_among_runs_of_the_longest_first_order(seed):
    rng = random.Random(100 + seed)
    world = rng.randint(2, 3)
    total = rng.randint(world, 9)
    ranks = random_ranks(rng, world, caps=False)
    costs = [float(rng.randint(1, 20)) for _ in range(total)]
    shares = split_step(costs, ranks)
    order = sorted(range(total), key=lambda i: -costs[i])
    assert sorted(i for share in shares for i in share) == list(range(total))
    best = math.inf
    for cuts in itertools.combinations(range(1, total), world - 1):
        bounds = (0, *cuts, total)
        runs = [order[bounds[r]:bounds[r + 1]] for r in range(world)]
        best = min(best, step_time(costs, runs, ranks))
    assert step_time(costs, shares, ranks) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_split_time_is_the_step_time_of_a_split_under_other_models(seed):
    # The policy weighs the plan in force by its new models: one split, judged by another rank's costs.
    rng = random.Random(200 + seed)
    world = rng.randint(1, 5)
    costs = [float(rng.randint(1, 9)) if seed % 2 else 1.0 for _ in range(rng.randint(1, 30))]
    planned_by, judged_by = random_ranks(rng, world, caps=True), random_ranks(rng, world, caps=True)
    assert split_time(costs, planned_by, judged_by) == step_time(costs, split_step(costs, planned_by), judged_by)


def test_a_faster_rank_gets_more_and_a_fixed_cost_is_counted():
    # Proportional shares at 2.1:1 would be 22 + 10 or 21 + 11; the fixed cost of rank 0 moves work off it.
    assert [len(s) for s in split_step([1.0] * 32, [RankCost(0, 1 / 2.1), RankCost(0, 1.0)])] == [22, 10]
    assert [len(s) for s in split_step([1.0] * 32, [RankCost(5.0, 0.5), RankCost(0.0, 0.5)])] == [11, 21]
    equal = split_step([1.0] * 32, [RankCost(0.1, 0.01)] * 2)
    assert [len(s) for s in equal] == [16, 16]


def test_micro_batches_respect_the_cap_and_pad_to_the_longest():
    costs = [8.0, 5.0, 5.0, 2.0, 1.0]
    assert micro_batches(costs, 10.0) == [(0, 1), (1, 3), (3, 5)]
    assert padded_units(costs, 10.0) == 8 + 2 * 5 + 2 * 2
    assert micro_batches([9.0], 4.0) == [(0, 1)], "an example larger than the cap still runs, alone"


def test_fit_recovers_a_line_and_falls_back_to_the_origin():
    fixed, per_unit = fit_affine([(8, 0.1 + 8 * 0.02, 1), (16, 0.1 + 16 * 0.02, 3), (24, 0.1 + 24 * 0.02, 1)])
    assert fixed == pytest.approx(0.1) and per_unit == pytest.approx(0.02)
    assert fit_affine([(16, 0.32, 5)]) == (0.0, pytest.approx(0.02))
    assert fit_affine([(8, 0.5, 1), (16, 0.3, 1)]) == (0.0, pytest.approx((8 * 0.5 + 16 * 0.3) / (64 + 256)))
    assert fit_affine([]) is None


def test_split_proportionally_adds_up_and_follows_the_weights():
    assert split_proportionally(32, [1, 1]) == [16, 16]
    assert split_proportionally(32, [2.0, 1.0]) == [21, 11]
    assert split_proportionally(5, [1, 1, 1]) == [2, 2, 1]
    assert sum(split_proportionally(1000, [0.3, 1.7, 2.2, 0.01])) == 1000
    with pytest.raises(ValueError):
        split_proportionally(4, [0, 0])


def test_bad_cost_models_are_refused():
    with pytest.raises(ValueError, match="per_unit_s"):
        split_step([1.0], [RankCost(0, 0)])
    with pytest.raises(ValueError, match="positive cost"):
        split_step([0.0], [RankCost(0, 1)])
    with pytest.raises(ValueError, match="rank 1: .*per_unit_s"):
        split_time([1.0, 2.0], [RankCost(0, 1)] * 2, [RankCost(0, 1), RankCost(0, math.inf)])
