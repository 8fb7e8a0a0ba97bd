"""A non-finite gradient on one rank, even one whose weight is 0: every rank sees it in the fused
stats and skips the step together, and a grad scaler's state stays identical on every rank."""

import pytest
import torch

from tests.distributed.workloads import global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]

POISONED_STEP, POISONED_RANK = 1, 1


def scaled_training(rank: int, world_size: int, poisoned_weight: int) -> list[dict]:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    poison = {"on": False}
    model.module.out.weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    history = []
    for step in range(5):
        _, _, slices = global_batch(step, [4] * world_size)
        x, y = slices[rank]
        poison["on"] = step == POISONED_STEP and rank == POISONED_RANK
        weight = poisoned_weight if poison["on"] else 4
        stats = model.backward(scaler.scale(mse(model(x), y)), weight=weight)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        history.append({"finite": stats.finite, "scale": scaler.get_scale(),
                        "growth": int(scaler._growth_tracker.item()),
                        "params": torch.cat([p.detach().flatten() for p in model.parameters()])})
    return history


@pytest.mark.parametrize("poisoned_weight", [4, 0], ids=["weighted-rank", "weight-0-rank"])
def test_nonfinite_gradient_skips_the_step_on_every_rank(poisoned_weight):
    histories = run_ranks(scaled_training, 3, poisoned_weight, timeout=60)
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
