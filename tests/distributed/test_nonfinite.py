"""A non-finite gradient on one rank, even one whose weight is 0: every rank sees it in the fused
stats and skips the step together, and a grad scaler's state stays identical on every rank."""

import pytest
import torch

from tests.distributed.workloads import global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]

POISONED_STEP, POISONED_RANK = 1, 1


class FewTensors(torch.nn.Module):
    """A model whose ShardedOptimizer leaves a rank owning no parameter: two layers on three ranks (the first
    layer's weight is nearer two thirds of the parameters than one, so rank 1 gets none), or one weight alone."""

    def __init__(self, one_tensor: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = None if one_tensor else torch.nn.Linear(4, 8, dtype=torch.float64)
        self.out = torch.nn.Linear(4 if one_tensor else 8, 1, bias=not one_tensor, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x if self.inp is None else torch.tanh(self.inp(x))).squeeze(-1)


def scaled_training(rank: int, world_size: int, poisoned_weight: int, sharded: bool = False,
                    device: str = "cpu", few_tensors: str | None = None) -> list[dict]:
    """Five steps under a GradScaler, the gradient of `out.weight` poisoned on one rank at one step. `few_tensors`
    ("two-layers", "one-tensor"): sharded, a model of which some rank owns nothing."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    net = make_net(seed=0) if few_tensors is None else FewTensors(few_tensors == "one-tensor")
    model = hsync.WeightedDDP(net.to(device))
    optimizer = (hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1) if sharded
                 else torch.optim.SGD(model.parameters(), lr=0.1))
    if few_tensors is not None:
        assert () in optimizer.layout.owned, optimizer.layout
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    poison = {"on": False}
    model.module.out.weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    history = []
    for step in range(5):
        _, _, slices = global_batch(step, [4] * world_size)
        x, y = (t.to(device) for t in slices[rank])
        poison["on"] = step == POISONED_STEP and rank == POISONED_RANK
        weight = poisoned_weight if poison["on"] else 4
        stats = model.backward(scaler.scale(mse(model(x), y)), weight=weight)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        history.append({"finite": stats.finite, "scale": scaler.get_scale(),
                        "growth": int(scaler._growth_tracker.item()),
                        "params": torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()})
    return history


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("poisoned_weight", [4, 0], ids=["weighted-rank", "weight-0-rank"])
def test_nonfinite_gradient_skips_the_step_on_every_rank(poisoned_weight, sharded):
    # Sharded, the NaN reaches out.weight's owner only, and every other rank's own gradients are finite: the
    # GradScaler of each must still skip and back off (Note [A non-finite step on every rank]).
    assert_skipped_alike(run_ranks(scaled_training, 3, poisoned_weight, sharded, timeout=60))


@pytest.mark.parametrize(("few_tensors", "world_size"), [("two-layers", 3), ("one-tensor", 2)])
def test_a_rank_that_owns_no_parameter_skips_alike_under_its_grad_scaler(few_tensors, world_size):
    # With no gradient of its own, torch's GradScaler on that rank would assert "No inf checks were recorded for
    # this optimizer"; it checks the witness's instead, which carries the NaN (Note [A non-finite step on every
    # rank]). The poison is on the rank that owns nothing, which the gradient of out.weight leaves for its owner.
    assert_skipped_alike(run_ranks(scaled_training, world_size, 4, True, "cpu", few_tensors, timeout=60))


def assert_skipped_alike(histories: list[list[dict]]) -> None:
    """The poisoned step skipped on every rank, with the same scale, growth tracker and parameters everywhere."""
    for rank, history in enumerate(histories):
        for step, (mine, rank0) in enumerate(zip(history, histories[0], strict=True)):
            assert mine["finite"] == rank0["finite"] and mine["scale"] == rank0["scale"], (rank, step)
            assert mine["growth"] == rank0["growth"], (rank, step)
            assert torch.equal(mine["params"], rank0["params"]), (rank, step)
    history = histories[0]
    assert [h["finite"] for h in history] == [s != POISONED_STEP for s in range(5)]
    # The poisoned step changed nothing but the scale, which backed off; growth resumed after it.
    assert torch.equal(history[POISONED_STEP]["params"], history[POISONED_STEP - 1]["params"])
    assert history[POISONED_STEP]["scale"] == history[POISONED_STEP - 1]["scale"] / 2
    assert not torch.equal(history[POISONED_STEP + 1]["params"], history[POISONED_STEP]["params"])
    assert history[-1]["scale"] == history[POISONED_STEP]["scale"] * 2


def a_sum_past_the_largest_float(rank: int, world_size: int, sharded: bool, layout: str) -> tuple[bool, bool]:
    """One step whose every rank's gradient, and weighted term, is a finite float32 near its largest value, while
    their sum is not: whether the step reads as finite, and whether this rank's gradients are. A channels_last
    weight's gradient is written back through a copy of its own layout."""
    import hsync

    if layout == "channels_last":
        net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 2), torch.nn.Flatten(), torch.nn.Linear(12, 1))
        net = net.to(memory_format=torch.channels_last)
        overflowing = net[0].weight
        x = torch.randn(2, 2, 3, 3).to(memory_format=torch.channels_last)
    else:
        net = make_net(seed=0, dtype=torch.float32)
        overflowing = net.out.weight
        x = global_batch(0, [2] * world_size, dtype=torch.float32)[2][rank][0]
    model = hsync.WeightedDDP(net)
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1) if sharded else None  # kept: it shards
    overflowing.register_hook(lambda g: torch.full_like(g, 2e38))
    stats = model.backward(model(x).square().mean(), weight=1)
    assert overflowing.grad is None or overflowing.grad.is_contiguous() == (layout == "contiguous")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    del optimizer
    return stats.finite, all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_a_sum_that_overflows_where_every_term_is_finite_is_not_a_finite_step(sharded, layout):
    # On the CPU the ranks' terms are summed before they are divided by the total weight (Note [Deferred
    # normalisation]): 2e38 + 2e38 is inf in float32. It read as a finite step, with inf in the gradients.
    for rank, (finite, grads_finite) in enumerate(run_ranks(a_sum_past_the_largest_float, 2, sharded, layout)):
        assert not finite and not grads_finite, rank


# Each rank's weight at each step; 0 is a dummy batch of 2 examples that counts for nothing. Step 1 has no example
# anywhere; at step 2 rank 1 has joined and rank 0's only batch is a dummy, so the step has none either.
EMPTY_STEP_WEIGHTS = [[4, 0, 0, 3], [2, 0]]


def batch_sizes(step: int) -> list[int]:
    return [w[step] if step < len(w) and w[step] else 2 for w in EMPTY_STEP_WEIGHTS]


def steps_without_examples(rank: int, world_size: int, sharded: bool) -> tuple[list[bool], dict[str, torch.Tensor]]:
    """AdamW with weight decay under model.join(), plain or sharded, skipping the steps that are not finite."""
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    kwargs = dict(lr=0.1, weight_decay=0.1)
    optimizer = (hsync.ShardedOptimizer(model, torch.optim.AdamW, **kwargs) if sharded
                 else torch.optim.AdamW(model.parameters(), **kwargs))
    finite = []
    with model.join():
        for step, weight in enumerate(EMPTY_STEP_WEIGHTS[rank]):
            x, y = global_batch(step, batch_sizes(step), dtype=torch.float32)[2][rank]
            stats = model.backward(mse(model(x), y), weight=weight)
            finite.append(stats.finite)
            if stats.finite:
                optimizer.step()
            optimizer.zero_grad()
    return finite, {name: p.detach() for name, p in model.module.named_parameters()}


@pytest.mark.parametrize("sharded", [False, True], ids=["adamw", "sharded-adamw"])
def test_a_step_without_an_example_anywhere_is_skipped_on_every_rank(sharded):
    # Its gradient was zeros and stats.finite true, so AdamW stepped: weight decay and the moments moved every
    # parameter on a step that had seen nothing. Under Join the joined rank, which shadows the sharded optimizer's
    # step when the step is finite, must decide as the active ranks do, or the ranks' collectives part.
    results = run_ranks(steps_without_examples, 2, sharded, timeout=60)
    assert [finite for finite, _ in results] == [[True, False, False, True], [True, False]]
    net = make_net(seed=0, dtype=torch.float32)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
    for step in (0, 3):
        slices = [s for s, w in zip(global_batch(step, batch_sizes(step), dtype=torch.float32)[2], EMPTY_STEP_WEIGHTS,
                                    strict=True) if step < len(w) and w[step]]
        mse(net(torch.cat([x for x, _ in slices])), torch.cat([y for _, y in slices])).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, (_, params) in enumerate(results):
        for name, value in net.named_parameters():
            torch.testing.assert_close(params[name], value.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")
