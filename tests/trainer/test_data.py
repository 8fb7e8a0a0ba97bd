"""Corpus reading, example building, masking and the uneven sampler."""

from pathlib import Path

import pytest
import torch

from hsync import data
from hsync.balance import parse_rank_values, plan_batch_sizes, rebalance

SLICE = Path(__file__).parents[1] / "data" / "kjv-genesis.txt"


def test_split_proportionally_adds_up_and_follows_the_weights():
    assert data.split_proportionally(32, [1, 1]) == [16, 16]
    assert data.split_proportionally(32, [2.0, 1.0]) == [21, 11]
    assert data.split_proportionally(5, [1, 1, 1]) == [2, 2, 1]
    assert sum(data.split_proportionally(1000, [0.3, 1.7, 2.2, 0.01])) == 1000
    with pytest.raises(ValueError):
        data.split_proportionally(4, [0, 0])


def test_plan_follows_speeds_keeps_the_global_batch_and_respects_memory():
    assert plan_batch_sizes(32, [300.0, 100.0]) == [24, 8]
    assert plan_batch_sizes(32, [1000.0, 1.0]) == [31, 1], "every rank keeps at least one example"
    assert plan_batch_sizes(32, [2.1, 1.0]) == [22, 10], "shortest step, not proportional rounding (21 + 11)"
    assert plan_batch_sizes(3, [100.0, 1.0, 1.0]) == [1, 1, 1]
    assert plan_batch_sizes(2, [1.0, 5.0, 1.0]) == [0, 2, 0]
    assert plan_batch_sizes(32, [300.0, 100.0], max_sizes=[20, 32]) == [20, 12]
    with pytest.raises(ValueError, match="does not fit"):
        plan_batch_sizes(64, [1.0, 1.0], max_sizes=[16, 16])


def test_rebalance_switches_plans_only_for_a_clear_predicted_gain():
    # 20+12 at a 2:1 speed ratio takes 12 units, 22+10 takes 11: 8% shorter, so it switches
    assert rebalance([20, 12], [2.0, 1.0]) == [22, 10]
    # at 1.95:1, 21+11 takes 11 units and 22+10 takes 11.3: the plan stays within 5%
    assert rebalance([22, 10], [1.95, 1.0]) == [22, 10]
    assert rebalance([16, 16], [1.0, 1.0]) == [16, 16]
    assert rebalance([16, 16], [300.0, 100.0], max_sizes=[20, 32]) == [20, 12]


def test_rank_values_are_parsed_with_clear_errors():
    assert parse_rank_values("1=2.0", 3, "--simulate-slowdown", 1.0) == [1.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="'5=2' is not RANK=VALUE with a rank below 2"):
        parse_rank_values("5=2", 2, "--simulate-slowdown", 1.0)


def test_an_epoch_under_changing_plans_covers_every_example_once_and_ends_together():
    world, n = 3, 1001
    samplers = [data.UnevenDistributedSampler(n, seed=7) for _ in range(world)]
    plans = [[5, 3, 8], [1, 10, 2], [7, 0, 7]]
    seen, step = [], 0
    while samplers[0].epoch == 0 and samplers[0].cursor < n:
        plan = plans[step % len(plans)]
        taken = [s.next_step(plan, r) for r, s in enumerate(samplers)]
        assert {epoch for _, epoch in taken} == {0}
        seen += [i for indices, _ in taken for i in indices]
        step += 1
    assert sorted(seen) == list(range(n))
    assert all(s.cursor == n for s in samplers), "every rank finishes the epoch at the same step"
    nxt, epoch = samplers[0].next_step([5, 3, 8], 0)
    assert epoch == 1 and len(nxt) == 5


def test_sampler_state_round_trips_and_refuses_other_data():
    a = data.UnevenDistributedSampler(50, seed=1)
    a.next_step([4, 4], 0)
    b = data.UnevenDistributedSampler(50, seed=1)
    b.load_state_dict(a.state_dict())
    assert a.next_step([3, 5], 1) == b.next_step([3, 5], 1)
    with pytest.raises(ValueError, match="other data"):
        data.UnevenDistributedSampler(60).load_state_dict(a.state_dict())


def test_missing_and_empty_corpora_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.read_documents(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="holds no text"):
        data.read_documents(empty)


def test_examples_and_masks_are_well_formed_and_reproducible(tmp_path):
    documents = data.read_documents(SLICE)
    assert len(documents) == 50  # Genesis: one document per chapter
    tokens = data.train_wordpiece_vocab(SLICE, 2000, tmp_path).read_text().splitlines()
    examples = data.build_examples(documents, tokens, max_seq_len=64)
    assert len(examples) > 500
    assert max(map(len, examples.input_ids)) <= 64
    assert 0.3 < sum(examples.is_random_next) / len(examples) < 0.7
    ids = {t: i for i, t in enumerate(tokens)}
    special = {ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")}

    def batch(indices, epoch=0):
        return data.collate(examples, indices, len(tokens), special, ids["[MASK]"], ids["[PAD]"], seed=3, epoch=epoch)

    first = batch(list(range(64)))
    again = batch(list(range(63, -1, -1)))  # the same examples in another batch and order
    assert torch.equal(first["labels"], again["labels"].flip(0)[:, : first["labels"].shape[1]])
    assert not torch.equal(first["labels"], batch(list(range(64)), epoch=1)["labels"])
    labelled = first["labels"] != -100
    assert labelled.any(dim=1).all(), "every example predicts at least one token"
    ratio = labelled.sum() / first["attention_mask"].sum()
    assert 0.08 < ratio < 0.25
    assert not torch.isin(first["labels"][labelled], torch.tensor(sorted(special))).any()


def test_a_rank_without_examples_in_the_window_gets_the_mean_speed():
    from hsync.balance import SpeedWindow

    window = SpeedWindow()
    window.add([30.0, 0.0, 10.0], [1.0, 0.0, 1.0])
    assert window.speeds() == [30.0, 20.0, 10.0]
