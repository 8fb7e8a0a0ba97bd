"""Who owns which parameters' optimizer state (hsync/sharding/shares.py): ranges in proportion to each rank's
capacity, sizes read as users write them, and a model that cannot fit refused naming every rank."""

import pytest
import torch

from hsync.sharding.shares import parse_bytes, plan_layout, this_ranks_budget

MIB = 2**20


@pytest.mark.parametrize(("text", "size"), [("6GiB", 6 * 2**30), ("512 MB", 512 * 10**6), ("1.5e3", 1500),
                                            (4096, 4096), ("2kib", 2048), (".5 KiB", 512), ("1e-3MB", 1000)])
def test_sizes_are_read_as_written(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize(("value", "message"), [("six GiB", "cannot read 'six GiB' as a size"),
                                                ("3 parsecs", "cannot read '3 parsecs'"), (0, "positive, finite"),
                                                ("1.2.3GiB", "cannot read '1.2.3GiB'"), (".", "cannot read '.'"),
                                                (-1, "positive, finite"), (float("inf"), "positive, finite"),
                                                ("-1", "positive, finite size of at least one byte, got '-1'"),
                                                ("0.5", "at least one byte, got '0.5'"), (0.5, "at least one byte")])
def test_a_size_that_means_nothing_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(value)
    with pytest.raises(TypeError, match="got bool True"):
        parse_bytes(True)


def test_a_budget_list_names_one_budget_per_rank():
    assert this_ranks_budget(["1MiB", "3MiB"], 1, 2, torch.device("cpu"), 100) == 3 * MIB
    assert this_ranks_budget(None, 0, 2, torch.device("cpu"), 100) is None
    with pytest.raises(ValueError, match="lists 3 budget"):
        this_ranks_budget(["1MiB"] * 3, 0, 2, torch.device("cpu"), 100)


def test_ranges_follow_the_capacity_beyond_the_whole_parameters_and_the_buckets_in_flight():
    sizes = [100] * 40  # 4000 bytes of parameters on every rank, 500 of buckets in flight
    # Capacities 3:1 for 12000 bytes of owned gradients (1 per parameter byte) and moments (2)
    layout = plan_layout(sizes, [4500 + 9000, 4500 + 3000], owned_per_byte=3.0, in_flight=500)
    assert [len(r) for r in layout.owned] == [30, 10]
    assert layout.owned == (tuple(range(0, 30)), tuple(range(30, 40)))
    assert layout.needs == (4500 + 9000, 4500 + 3000)


def test_undeclared_budgets_share_equally_and_a_rank_may_own_nothing():
    assert [len(r) for r in plan_layout([10] * 9, [None] * 3, 3.0).owned] == [3, 3, 3]
    assert [len(r) for r in plan_layout([10], [None, None], 3.0).owned] in ([1, 0], [0, 1])


def test_a_tensor_is_whole_and_goes_to_the_nearest_boundary():
    layout = plan_layout([10, 80, 10], [None, None], 2.0)  # half of 100 falls inside the big tensor
    assert sum(len(r) for r in layout.owned) == 3 and len(layout.owned[0]) in (1, 2)


def test_a_model_that_cannot_fit_is_refused_naming_each_rank_its_budget_and_need():
    with pytest.raises(ValueError) as error:  # 4 MiB whole + 1 in flight + 12 MiB of gradients and moments
        plan_layout([MIB] * 4, [10 * MIB, 11 * MIB], owned_per_byte=3.0, in_flight=MIB)
    message = str(error.value)
    assert "rank 0: budget 10.0 MiB" in message and "rank 1: budget 11.0 MiB" in message, message
    assert "parameters whole (4.0 MiB)" in message and "buckets in flight (1.0 MiB)" in message, message
    assert "gradients and optimizer state (12.0 MiB in all)" in message, message
    with pytest.raises(ValueError, match=r"rank 0: budget 12.0 MiB, needs 13.0 MiB"):
        plan_layout([3 * MIB, MIB], [12 * MIB, 12 * MIB], owned_per_byte=3.0)  # fits in sum, not whole tensors
    with pytest.raises(ValueError, match="on every rank or on none"):
        plan_layout([MIB], [None, 4 * MIB], owned_per_byte=3.0)


def test_parameters_outside_the_groups_cost_every_rank_their_gradients_and_no_range_anything():
    # Parameters 0-9 outside the optimizer's groups (another optimizer steps them): their gradients are whole on
    # every rank (1 byte per parameter byte here), their optimizer state is not this optimizer's.
    sizes = [100] * 40  # 4000 bytes of parameters, 500 in flight, 1000 of gradients outside the groups
    budgets = [5500 + 6900, 5500 + 2100]  # capacities 23:7 for the 30 grouped parameters' 9000 bytes of state
    layout = plan_layout(sizes, budgets, owned_per_byte=3.0, in_flight=500, outside=set(range(10)),
                         outside_per_byte=1.0)
    assert [sum(1 for i in r if i >= 10) for r in layout.owned] == [23, 7], layout.owned
    assert layout.needs == tuple(budgets)
    with pytest.raises(ValueError, match=r"outside the optimizer's groups \(1.0 KiB\)"):
        plan_layout(sizes, [b - 500 for b in budgets], owned_per_byte=3.0, in_flight=500, outside=set(range(10)),
                    outside_per_byte=1.0)


def test_a_group_added_later_keeps_what_is_owned_and_fills_what_each_rank_lacks():
    # Ten parameters of 100 bytes owned 5 + 5 (equal shares), thirty more added: the first ten stay where they are
    # and the thirty go 15 + 15, each rank's part contiguous.
    first = plan_layout([100] * 40, [None, None], owned_per_byte=3.0, outside=set(range(10, 40)))
    kept = [[i for i in owned if i < 10] for owned in first.owned]
    assert kept == [list(range(5)), list(range(5, 10))], first.owned
    added = plan_layout([100] * 40, [None, None], owned_per_byte=3.0, kept=kept)
    assert added.owned == (tuple(range(5)) + tuple(range(10, 25)), tuple(range(5, 10)) + tuple(range(25, 40)))
    # What lacks is what is filled: a rank already past its share takes nothing of the rest.
    lopsided = plan_layout([100] * 40, [None, None], owned_per_byte=3.0, kept=[[], list(range(25))])
    assert lopsided.owned == (tuple(range(25, 40)), tuple(range(25)))
    # Declared budgets: what a rank lacks counts its budget, and a group that does not fit is refused.
    with pytest.raises(ValueError, match=r"rank 1: budget 4.0 KiB, needs"):
        plan_layout([100] * 40, [40000, 4096], owned_per_byte=3.0, kept=[[], list(range(10))])
