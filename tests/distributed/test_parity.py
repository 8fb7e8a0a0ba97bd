"""WeightedDDP against a single process on the concatenated global batch, over real gloo ranks."""

import pytest
import torch

from tests.distributed.workloads import (
    GRAD_MODES,
    TINY_BUCKET_MB,
    global_batch,
    make_net,
    mse,
    reference_training,
    train_weighted,
)
from tests.spawn import run_ranks, run_ranks_expecting_errors

pytestmark = [pytest.mark.distributed, pytest.mark.quick]

# float64 throughout: the only differences left are summation order, far below this.
TOL = dict(rtol=1e-10, atol=1e-12)


def assert_matches_reference(results, steps, branch_ranks=frozenset()):
    ref_params, ref_grads, ref_losses = reference_training(steps, branch_ranks)
    total = [sum(sum(sizes) for sizes in micro) for micro in steps]
    for rank, (params, grads, stats, _) in enumerate(results):
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, **TOL, msg=f"rank {rank}, {name}")
        for name, value in ref_grads.items():
            if value is None:
                assert grads[name] is None, f"rank {rank}: {name} is unused everywhere but got a gradient"
            else:
                torch.testing.assert_close(grads[name], value, **TOL, msg=f"rank {rank}, grad of {name}")
        assert [s[1] for s in stats] == total
        assert [s[0] for s in stats] == pytest.approx(ref_losses, rel=1e-12)
        assert all(s[2] for s in stats)


@pytest.mark.parametrize("grads", GRAD_MODES)
def test_uneven_batches_over_three_ranks_match_one_process(grads):
    steps = [[[3, 7, 2]], [[5, 1, 6]], [[4, 4, 9]], [[2, 9, 3]]]
    results = run_ranks(train_weighted, 3, steps, frozenset(), TINY_BUCKET_MB, "cpu", grads)
    assert_matches_reference(results, steps)
    buckets = results[0][3]
    assert len(buckets) >= 4, "the tiny cap should give many buckets"
    assert all(r[3] == buckets for r in results), "ranks disagree on the rebuilt buckets"


def test_rank_with_weight_zero_contributes_nothing():
    steps = [[[3, 0, 2]], [[0, 5, 1]], [[4, 4, 0]]]
    assert_matches_reference(run_ranks(train_weighted, 3, steps), steps)


@pytest.mark.parametrize("grads", GRAD_MODES)
def test_no_sync_accumulation_equals_one_big_batch(grads):
    # Micro-batch sizes differ between ranks and micro-steps, including an empty first micro-batch.
    steps = [[[2, 5], [4, 1], [3, 3]], [[0, 2], [6, 1]], [[1, 1], [0, 7], [2, 0]]]
    assert_matches_reference(run_ranks(train_weighted, 2, steps, frozenset(), TINY_BUCKET_MB, "cpu", grads), steps)


@pytest.mark.parametrize("grads", GRAD_MODES)
def test_parameters_unused_on_some_or_all_ranks(grads):
    # 'branch' gets a gradient on rank 1 only; 'never_used' on no rank and must keep none.
    steps = [[[3, 4, 2]], [[1, 5, 3]], [[2, 2, 2]]]
    results = run_ranks(train_weighted, 3, steps, {1}, TINY_BUCKET_MB, "cpu", grads)
    assert_matches_reference(results, steps, branch_ranks={1})
    assert all(r[1]["never_used.weight"] is None for r in results)


def test_one_big_bucket_gives_the_same_result():
    steps = [[[3, 7]], [[5, 1]]]
    assert_matches_reference(run_ranks(train_weighted, 2, steps, frozenset(), 25.0), steps)


@pytest.mark.parametrize("compiled", ["module", "wrapper"])
def test_torch_compile_keeps_weighted_steps_exact(compiled):
    # torch.compile(net) wrapped, as nanoGPT does with DDP, or the wrapper compiled: uneven
    # micro-batches under no_sync, a branch one rank uses, a parameter no rank uses.
    steps = [[[2, 5], [4, 1]], [[3, 3], [0, 6]], [[5, 2], [1, 1]]]
    results = run_ranks(train_weighted, 2, steps, {1}, TINY_BUCKET_MB, "cpu", "copied", compiled, timeout=300)
    assert_matches_reference(results, steps, branch_ranks={1})
    assert all(r[1]["never_used.weight"] is None for r in results)


def abandoned_accumulation(rank: int, world_size: int, ending: str) -> dict:
    """Weighted micro-steps under no_sync, then the step abandoned as with DDP (optimizer.zero_grad()), and a new
    step of one micro-batch; beside a wrapper that ran only that step. `ending`: "weighted" or "plain", the new
    step's backward ("weighted-zeroed": zero_grad(set_to_none=False)); "plain-without-zero-grad": a plain backward
    ends the weighted micro-steps."""
    import hsync

    models = [hsync.WeightedDDP(make_net(seed=0)) for _ in range(2)]
    optimizer = torch.optim.SGD(models[0].parameters(), lr=0.1)
    _, _, shares = global_batch(0, [3, 5][:world_size])
    x, y = shares[rank]
    with models[0].no_sync():
        for _ in range(2):
            models[0].backward(mse(models[0](x), y), weight=len(x))
    if ending != "plain-without-zero-grad":  # the epoch ended mid-accumulation: its micro-batches dropped
        optimizer.zero_grad(set_to_none=ending != "weighted-zeroed")
    _, _, shares = global_batch(1, [2, 4][:world_size])
    x, y = shares[rank]
    stats = []
    for model in models:
        loss = mse(model(x), y)
        if ending.startswith("weighted"):
            stats.append(model.backward(loss, weight=len(x)).weight)
        else:
            loss.backward()
    return {"stats": stats, "grads": [{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                                      for model in models]}


@pytest.mark.parametrize("ending", ["weighted", "weighted-zeroed", "plain"])
def test_a_step_abandoned_mid_accumulation_leaves_nothing_in_the_next(ending):
    # Its weights stayed in the step's scalars: the next weighted step counted 22 examples where it had 6, and its
    # gradient came out 6 times too small. zero_grad() sets the gradients to None, or zeroes them in place.
    for result in run_ranks(abandoned_accumulation, 2, ending, timeout=60):
        if ending.startswith("weighted"):
            assert result["stats"] == [6.0, 6.0]
        ours, fresh = result["grads"]
        torch.testing.assert_close(ours, fresh, rtol=1e-12, atol=1e-14)


def test_a_plain_backward_ending_weighted_micro_steps_is_refused_on_every_rank():
    # It ended their window unweighted, and the next weighted step counted their weights.
    for error in run_ranks_expecting_errors(abandoned_accumulation, 2, "plain-without-zero-grad", timeout=60):
        assert "this step's earlier micro-batches were weighted (model.backward(loss, weight=n) under no_sync), " \
               "and a plain loss.backward() would end it unweighted" in error, error
