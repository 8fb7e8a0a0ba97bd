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


MISMATCHES = {
    "order": ({"right": 1.0, "count": 2.0}, {"count": 2.0, "right": 1.0}, "ranks passed different metric names"),
    "count": ({"right": 1.0, "count": 2.0}, {"right": 1.0, "count": 2.0, "loss": 0.5},
              "ranks passed different metric names"),
    "shape": ({"loss": 1.0}, {"loss": torch.ones(3)}, "rank 1 passed a value that is not one number"),
    "type": ({"loss": 1.0}, {"loss": "high"}, "rank 1 passed a value that is not one number"),
    "not a mapping": ({"loss": 1.0}, [1.0], "rank 1 passed a value that is not one number"),
}


def mismatched_values(rank: int, world_size: int, case: str) -> None:
    import hsync

    hsync.sum_over_ranks(MISMATCHES[case][rank])


@pytest.mark.parametrize("case", MISMATCHES)
def test_ranks_that_pass_different_or_bad_metrics_all_fail(case):
    # Also when only one rank's are bad, or a rank names more: never a reduction of different sizes.
    for text in run_ranks_expecting_errors(mismatched_values, 2, case):
        assert MISMATCHES[case][2] in text, text


def bad_sampler(rank: int, world_size: int) -> str:
    import hsync

    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        hsync.ShardSampler(10, 0)
    return "refused"


def test_a_nonsense_batch_size_is_refused():
    assert run_ranks(bad_sampler, 2) == ["refused", "refused"]
