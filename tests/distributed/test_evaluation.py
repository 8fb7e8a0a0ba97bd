"""hsync.ShardSampler and hsync.sum_over_ranks: exact global metrics from uneven shards, on real ranks."""

import pytest
import torch

from tests.spawn import run_ranks, run_ranks_expecting_errors

pytestmark = pytest.mark.distributed


CASES = [(10, 3), (2, 4), (0, 1)]  # (examples, batch size): uneven shards, a rank with none, no data at all


def shard_and_sum(rank: int, world_size: int):
    import hsync

    results = []
    for num_examples, batch_size in CASES:
        values = torch.arange(num_examples, dtype=torch.float64) * 0.1
        sampler = hsync.ShardSampler(num_examples, batch_size)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        total, count = torch.zeros((), dtype=torch.float64), 0
        for indices in batches:
            total += values[indices].sum()
            count += len(indices)
        results.append((batches, hsync.sum_over_ranks({"total": total, "count": count, "ones": 1.0})))
    return results


def test_every_example_is_evaluated_once_and_the_sums_are_global():
    world = 3
    per_rank = run_ranks(shard_and_sum, world)
    for case, (num_examples, batch_size) in enumerate(CASES):
        results = [ranks_cases[case] for ranks_cases in per_rank]
        seen = [i for batches, _ in results for batch in batches for i in batch]
        assert sorted(seen) == list(range(num_examples)), "each example on exactly one rank, none repeated"
        assert all(len(batch) <= batch_size for batches, _ in results for batch in batches)
        expected = (torch.arange(num_examples, dtype=torch.float64) * 0.1).sum().item()
        for _, totals in results:
            assert totals == {"total": pytest.approx(expected, rel=1e-12), "count": num_examples, "ones": world}


def mismatched_names(rank: int, world_size: int) -> None:
    import hsync

    hsync.sum_over_ranks({"right": 1.0, "count": 2.0} if rank == 0 else {"count": 2.0, "right": 1.0})


def test_ranks_that_name_different_metrics_all_fail():
    for text in run_ranks_expecting_errors(mismatched_names, 2):
        assert "ranks passed different metric names" in text, text


def bad_values(rank: int, world_size: int) -> str:
    import hsync

    with pytest.raises(ValueError, match="'loss' must be one number, got shape"):
        hsync.sum_over_ranks({"loss": torch.ones(3)})
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        hsync.ShardSampler(10, 0)
    return "refused"


def test_values_that_are_not_one_number_are_refused_before_the_reduction():
    assert run_ranks(bad_values, 2) == ["refused", "refused"]
