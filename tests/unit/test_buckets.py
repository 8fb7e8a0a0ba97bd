"""compute_bucket_assignment (csrc/bucket.cpp) through the extension."""

import pytest

from hsync import _C

KIB = 1024


def assign(sizes, groups=None, order=None, cap=100 * KIB, first_cap=10 * KIB):
    groups = groups or [0] * len(sizes)
    order = order if order is not None else list(reversed(range(len(sizes))))
    return _C.compute_bucket_assignment(sizes, groups, order, cap, first_cap)


def test_buckets_follow_the_order_and_close_at_their_cap():
    # Reverse registration order; the first bucket closes at 10 KiB, the others at 100 KiB.
    sizes = [40 * KIB] * 6 + [4 * KIB] * 3
    assert assign(sizes) == [[8, 7, 6], [5, 4, 3], [2, 1, 0]]


def test_every_parameter_lands_in_exactly_one_bucket():
    sizes = [(i * 7919) % 50 * KIB + 1 for i in range(200)]
    buckets = assign(sizes, cap=64 * KIB, first_cap=8 * KIB)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(200))
    for bucket in buckets[1:-1]:
        # A bucket is closed by the parameter that takes it to its cap: without that one it was below.
        assert sum(sizes[i] for i in bucket[:-1]) < 64 * KIB <= sum(sizes[i] for i in bucket)


def test_groups_never_share_a_bucket_and_launch_in_order_of_first_use():
    sizes = [KIB] * 6
    groups = [0, 1, 0, 1, 0, 1]
    buckets = assign(sizes, groups, order=[0, 1, 2, 3, 4, 5], cap=2 * KIB, first_cap=KIB)
    assert buckets == [[0], [1], [2, 4], [3, 5]]
    for bucket in buckets:
        assert len({groups[i] for i in bucket}) == 1


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own():
    assert assign([10 * KIB, 500 * KIB, 10 * KIB], order=[0, 1, 2]) == [[0], [1], [2]]


@pytest.mark.parametrize("order", [[0, 1], [0, 0, 1], [0, 3, 1]])
def test_an_order_that_is_not_a_permutation_is_refused(order):
    with pytest.raises((ValueError, RuntimeError), match="order"):
        assign([KIB] * 3, order=order)
