"""hsync.ShardedOptimizer against the unsharded optimizer over the same WeightedDDP steps, side by side on
each rank: the same parameters after every step (uneven weighted batches, no_sync micro-batches, clipping,
bf16 on the wire, a learning-rate schedule, 2 and 3 ranks with uneven budgets), its state where the
budgets put it, and checkpoints that resume on other ranks and budgets."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.distributed.workloads import TINY_BUCKET_MB, global_batch, make_net, mse
from tests.spawn import run_ranks, run_ranks_expecting_errors

pytestmark = pytest.mark.distributed

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "adamw-foreach": (torch.optim.AdamW, dict(lr=0.01, foreach=True)),
    "adamw-fused": (torch.optim.AdamW, dict(lr=0.01, fused=True)),
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05)),
}
MIB = 2**20


def sizes_of(step: int, world_size: int) -> list[list[int]]:
    """Per micro-batch, each rank's examples: uneven, a rank with none in some micro-batches."""
    uneven = [[3, 5, 1], [1, 6, 4], [4, 0, 2], [2, 3, 3]][step % 4][:world_size]
    return [uneven, uneven[::-1]] if step % 2 else [uneven]


def train_side_by_side(rank: int, world_size: int, optimizer: str, budgets, steps: int = 6, clip: float | None = 2.0,
                       comm_dtype: torch.dtype | None = None, skip_owner: int | None = None,
                       device: str = "cpu") -> dict:
    """The same steps through an unsharded optimizer and a ShardedOptimizer: each model's parameters after each
    step (on the CPU), the norms clipping returned (`clip`: its norm type; None: no clipping), and what the sharded
    one holds."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)

    cls, kwargs = OPTIMIZERS[optimizer]
    models, optimizers, schedules = [], [], []
    for sharded in (False, True):
        model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32).to(device), bucket_cap_mb=TINY_BUCKET_MB,
                                  comm_dtype=comm_dtype)
        opt = hsync.ShardedOptimizer(model, cls, memory_budget=budgets, **kwargs) if sharded \
            else cls(model.parameters(), **kwargs)
        models.append(model)
        optimizers.append(opt)
        schedules.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)))
    if skip_owner is not None:  # a mutation: one owner's parameters never sent
        sharded_opt = optimizers[1]
        owned = list(sharded_opt.layout.owned)
        owned[skip_owner] = ()
        object.__setattr__(sharded_opt.layout, "owned", tuple(owned))
    out = {"whole": [], "sharded": [], "norms": []}
    for step in range(steps):
        norms = []
        for name, model, opt, schedule in zip(("whole", "sharded"), models, optimizers, schedules, strict=True):
            opt.zero_grad()
            micro = sizes_of(step, world_size)
            for k, sizes in enumerate(micro):
                _, _, parts = global_batch(step, sizes, micro=k, dtype=torch.float32)
                x, y = (t.to(device) for t in parts[rank])
                last = k == len(micro) - 1
                with model.no_sync() if not last else contextlib.nullcontext():
                    stats = model.backward(mse(model(x, use_branch=rank == 1), y) if len(x) else
                                           model(x).sum() * 0, weight=len(x))
            assert stats.finite
            if clip is not None:
                norms.append(float(opt.clip_grad_norm_(0.05, clip) if name == "sharded" else
                                   torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, clip)))
            opt.step()
            schedule.step()
            out[name].append({n: p.detach().cpu() for n, p in model.module.named_parameters()})
        out["norms"].append(norms)
    sharded_opt = optimizers[1]
    out["owned"] = list(sharded_opt.layout.owned[rank])
    out["with_grad"] = [i for i, p in enumerate(models[1].module.parameters()) if p.grad is not None]
    out["state_bytes"] = sum(t.numel() * t.element_size() for s in sharded_opt.state.values() for t in s.values()
                             if isinstance(t, torch.Tensor) and t.dim() > 0)
    out["lr"] = [group["lr"] for group in sharded_opt.param_groups]
    return out


def assert_same_training(results: list[dict], exact: bool = True) -> None:
    for rank, result in enumerate(results):
        for step, (whole, sharded) in enumerate(zip(result["whole"], result["sharded"], strict=True)):
            for name in whole:
                if exact:
                    assert torch.equal(whole[name], sharded[name]), f"rank {rank}, step {step}, {name}"
                else:
                    torch.testing.assert_close(sharded[name], whole[name], rtol=1e-5, atol=1e-6,
                                               msg=f"rank {rank}, step {step}, {name}")
        for norms in result["norms"]:  # none without clipping
            assert norms[1:] == pytest.approx(norms[:1], rel=1e-5), result["norms"]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sharded_steps_equal_the_unsharded_optimizers_on_uneven_budgets(optimizer):
    results = run_ranks(train_side_by_side, 2, optimizer, [3 * MIB, 1 * MIB])
    # Clipping sums the norms in another order: equal within float32 rounding, and so the steps after it.
    assert_same_training(results, exact=False)
    owned = [set(r["owned"]) for r in results]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(10)), owned
    assert all(r["state_bytes"] > 0 for r in results), [r["state_bytes"] for r in results]
    assert results[0]["lr"] == [pytest.approx(OPTIMIZERS[optimizer][1]["lr"] / 7)]  # the schedule reached it


def test_without_clipping_two_ranks_step_bitwise_as_the_unsharded_optimizer():
    # A sum of two is the same in any order: each owner's reduce gives the all-reduce's bits.
    assert_same_training(run_ranks(train_side_by_side, 2, "adamw", ["3MiB", "1MiB"], 6, None), exact=True)


def test_three_ranks_with_uneven_budgets_step_as_the_unsharded_optimizer():
    # gloo's reduce sums three terms in another order than its all-reduce: equal within float32 rounding.
    # Every collective compared across ranks before it runs (HSYNC_DEBUG_COLLECTIVES): reduces, the owned
    # buckets' flags and the owners' broadcasts line up.
    results = run_ranks(train_side_by_side, 3, "adamw", ["3MiB", "1MiB", "2MiB"], 6, None,
                        env={"HSYNC_DEBUG_COLLECTIVES": "1"})
    assert_same_training(results, exact=False)
    assert sorted(i for r in results for i in r["owned"]) == list(range(10))
    # Each gradient reached its owner only: the others dropped theirs (never_used, 6 and 7, has none).
    for result in results:
        assert set(result["with_grad"]) == set(result["owned"]) - {6, 7}, result


@pytest.mark.parametrize("norm_type", [1.0, math.inf], ids=["l1", "largest"])
def test_clipping_by_another_norm_clips_as_torchs_own_over_three_ranks(norm_type):
    # The largest entry is what transformers' Trainer asks for its logged norm (max_grad_norm=0): a maximum, not a
    # sum, over the owners' shards.
    assert_same_training(run_ranks(train_side_by_side, 3, "adamw", ["3MiB", "1MiB", "2MiB"], 4, norm_type),
                         exact=False)


def test_bf16_on_the_wire_keeps_the_sharded_steps_those_of_the_unsharded_optimizer():
    results = run_ranks(train_side_by_side, 2, "adamw", None, 4, 2.0, torch.bfloat16)
    assert_same_training(results, exact=False)


def test_a_skipped_owner_range_is_caught():
    """The mutation check: if one owner's updated parameters never reach the others, the comparison fails."""
    results = run_ranks(train_side_by_side, 2, "adamw", None, 2, None, None, 0)
    with pytest.raises(AssertionError, match=r"rank [01], step [01], "):
        assert_same_training(results, exact=True)


def partial_groups_side_by_side(rank: int, world_size: int, sharded_first: bool) -> dict:
    """A ShardedOptimizer over the weights only, SGD with momentum over the biases on every rank, stepped in
    either order; from step 4 the sharded optimizer takes the biases in a group of their own (add_param_group)
    and the SGD is dropped. The same through an unsharded WeightedDDP and AdamW, as assert_same_training reads."""
    import hsync

    out: dict = {"whole": [], "sharded": [], "norms": [], "bias_grads": []}
    for name in ("whole", "sharded"):
        model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32), bucket_cap_mb=TINY_BUCKET_MB)
        weights = [p for n, p in model.module.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.module.named_parameters() if not n.endswith("weight")]
        adamw = hsync.ShardedOptimizer(model, torch.optim.AdamW, memory_budget=["3MiB", "1MiB"], params=weights,
                                       lr=0.01) if name == "sharded" else torch.optim.AdamW(weights, lr=0.01)
        sgd: torch.optim.Optimizer | None = torch.optim.SGD(biases, lr=0.05, momentum=0.9)
        for step in range(6):
            if step == 4:
                adamw.add_param_group({"params": biases, "lr": 0.02})
                sgd = None
            _, _, parts = global_batch(step, sizes_of(step, world_size)[0], dtype=torch.float32)
            x, y = parts[rank]
            loss = mse(model(x, use_branch=rank == 1), y) if len(x) else model(x).sum() * 0
            assert model.backward(loss, weight=len(x)).finite
            if name == "sharded" and sgd is not None:
                out["bias_grads"].append(sum(p.grad is not None for p in biases))
            for optimizer in ([adamw, sgd] if sharded_first else [sgd, adamw]):
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad()
            out[name].append({n: p.detach().clone() for n, p in model.module.named_parameters()})
    return out


@pytest.mark.parametrize("sharded_first", [True, False], ids=["sharded-first", "other-first"])
def test_parameters_outside_the_groups_keep_whole_gradients_for_an_optimizer_of_their_own(sharded_first):
    # As with DDP and ZeroRedundancyOptimizer: the model's parameters outside the sharded optimizer's groups are
    # all-reduced, not reduced to an owner, so another optimizer steps them alike on every rank.
    results = run_ranks(partial_groups_side_by_side, 2, sharded_first)
    assert_same_training(results, exact=True)
    with_grads = [r["bias_grads"] for r in results]
    assert with_grads[0] == with_grads[1] and min(with_grads[0]) > 0, with_grads


def a_backbone_added_later(rank: int, world_size: int, budgets: list[str], how: str = "trainable-at-wrap",
                           device: str = "cpu") -> dict:
    """Fine-tuning's order: a ShardedOptimizer over the head, the backbone's group added at step 2
    (add_param_group), each rank's share of the state then; and the same steps with AdamW, unsharded. `how` the
    backbone waits: "trainable-at-wrap" (its gradients whole on every rank, outside the groups), or frozen at the
    wrap and unfrozen at step 2, then "refresh-then-add" (a loop's own order) or "add-unfrozen" (Lightning's
    BackboneFinetuning: add_param_group takes it into the buckets itself)."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    out: dict = {"whole": [], "sharded": [], "norms": []}
    for name in ("whole", "sharded"):
        net = make_net(seed=0, dtype=torch.float32).to(device)
        backbone = [p for n, p in net.named_parameters() if not n.startswith("out.")]
        for p in backbone:
            p.requires_grad_(how == "trainable-at-wrap")
        model = hsync.WeightedDDP(net, bucket_cap_mb=TINY_BUCKET_MB)
        head = list(model.module.out.parameters())
        optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, memory_budget=budgets, params=head, lr=0.01) \
            if name == "sharded" else torch.optim.AdamW(head, lr=0.01)
        for step in range(6):
            if step == 2:
                for p in backbone:
                    p.requires_grad_(True)
                if how == "refresh-then-add" or (how == "add-unfrozen" and name == "whole"):
                    assert model.refresh_trainable_parameters()
                optimizer.add_param_group({"params": iter(backbone), "lr": 0.005})
            _, _, parts = global_batch(step, sizes_of(step, world_size)[0], dtype=torch.float32)
            x, y = (t.to(device) for t in parts[rank])
            loss = mse(model(x, use_branch=rank == 1), y) if len(x) else model(x).sum() * 0
            assert model.backward(loss, weight=len(x)).finite
            optimizer.step()
            model.zero_grad()
            out[name].append({n: p.detach().cpu().clone() for n, p in model.module.named_parameters()})
        if name == "sharded":
            everything = optimizer._all
            out["owned_bytes"] = [sum(everything[i].numel() * everything[i].element_size() for i in owned)
                                  for owned in optimizer.layout.owned]
            out["refreshed"] = model.refresh_trainable_parameters()  # nothing left to take in
    return out


@pytest.mark.parametrize("how", ["trainable-at-wrap", "refresh-then-add", "add-unfrozen"])
@pytest.mark.parametrize("budgets", [["3MiB", "1MiB"], ["1MiB", "3MiB"]], ids=["3:1", "1:3"])
def test_a_group_added_later_is_shared_by_the_budgets_and_steps_as_unsharded(budgets, how):
    # The head's state stays with its owner; the backbone's is split by what each rank lacks of its share, so the
    # state ends 3:1 on budgets 3:1 (it all went to one rank, wherever the head's range left the backbone, before).
    # Frozen at the wrap, the backbone is taken into the buckets first (outside the groups until added).
    results = run_ranks(a_backbone_added_later, 2, budgets, how)
    assert_same_training(results, exact=True)
    owned = results[0]["owned_bytes"]
    large = 0 if budgets[0] == "3MiB" else 1
    assert abs(owned[large] / sum(owned) - 0.75) < 0.1, owned
    assert [r["refreshed"] for r in results] == [False, False]


def frozen_group_parameter_then_refresh(rank: int, world_size: int) -> str:
    """A parameter of the ShardedOptimizer's groups frozen, another unfrozen, then a refresh: refused."""
    import hsync

    net = make_net(seed=0, dtype=torch.float32)
    net.inp.requires_grad_(False)
    model = hsync.WeightedDDP(net)
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    net.inp.requires_grad_(True)
    net.out.weight.requires_grad_(False)
    try:
        model.refresh_trainable_parameters()
    except RuntimeError as error:
        return str(error)
    return f"refreshed under {optimizer}"


def test_a_refresh_that_would_leave_a_grouped_parameter_out_of_the_buckets_is_refused_on_every_rank():
    for error in run_ranks(frozen_group_parameter_then_refresh, 2):
        assert "parameter 'inp.weight' trains now but is in no bucket" in error, error
        assert "the ShardedOptimizer steps 'out.weight', which is frozen now" in error, error


def groups_that_differ(rank: int, world_size: int) -> None:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    weights = [p for n, p in model.module.named_parameters() if n.endswith("weight")]
    hsync.ShardedOptimizer(model, torch.optim.SGD, params=weights if rank == 0 else list(model.parameters()), lr=1)


def test_groups_that_differ_between_ranks_are_refused_on_every_rank():
    for error in run_ranks_expecting_errors(groups_that_differ, 2):
        assert "the ranks' parameter groups hold different parameters" in error, error


def stepped_inside_a_step(rank: int, world_size: int, how: str) -> None:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    _, _, shares = global_batch(0, [4] * world_size, dtype=torch.float32)
    x, y = shares[rank]
    with model.no_sync():
        model.backward(mse(model(x), y), weight=4)
    optimizer.clip_grad_norm_(1.0) if how == "clip" else optimizer.step()


@pytest.mark.parametrize("how", ["clip", "step"])
def test_a_step_or_clip_between_a_steps_micro_batches_is_refused_before_its_collectives(how):
    # Clipping after every micro-batch (right where each batch is a step) met the peer's step reduction with a
    # collective of another size: gloo ended the process.
    what = "clip_grad_norm_" if how == "clip" else "step"
    for error in run_ranks_expecting_errors(stepped_inside_a_step, 2, how):
        assert f"hsync.ShardedOptimizer.{what}: the model holds micro-batches accumulated under no_sync" in error, \
            error


def gradient_bytes_kept(rank: int, world_size: int, sharded: bool) -> tuple[int, int]:
    """(bytes a model's steps leave alive beyond its parameters, the parameters' bytes) on this rank, with the
    gradients kept as bucket views and set_to_none=False, so that what stays is what the reduction holds."""
    import hsync
    from hsync.bench.memory import live_bytes

    cpu = torch.device("cpu")
    before = live_bytes(cpu)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512, bias=False) for _ in range(8)]  # 1 MiB each: a bucket each
    model = hsync.WeightedDDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.5, gradient_as_bucket_view=True)
    optimizer = (hsync.ShardedOptimizer(model, torch.optim.SGD, memory_budget=["1GiB"] * world_size, lr=0.1)
                 if sharded else torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 512)
    for _ in range(3):  # the buckets are rebuilt after the first
        model.backward(model(x).square().mean(), weight=len(x))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return live_bytes(cpu) - before - parameters, parameters


def bucket_bytes_over_a_step(rank: int, world_size: int) -> dict[str, float]:
    """The engine's allocated bucket bytes, over the parameters' bytes: wrapped, after a whole step, and after a
    sharded step of another model (budgets 3:1)."""
    import hsync

    def wrapped() -> hsync.WeightedDDP:
        return hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32), bucket_cap_mb=TINY_BUCKET_MB)

    def step(model: hsync.WeightedDDP, optimizer: torch.optim.Optimizer) -> None:
        for _ in range(2):  # the first rebuilds the buckets, in the order gradients came, with no buffer yet
            x = torch.randn(4, 4)
            model.backward(model(x).square().mean(), weight=len(x))
            optimizer.step()

    whole, sharded = wrapped(), wrapped()
    parameters = sum(p.numel() * p.element_size() for p in whole.parameters())
    out = {"wrapped": whole._ensure_engine().allocated_bucket_bytes() / parameters}
    step(whole, torch.optim.SGD(whole.parameters(), lr=0.1))
    out["whole step"] = whole._ensure_engine().allocated_bucket_bytes() / parameters
    optimizer = hsync.ShardedOptimizer(sharded, torch.optim.SGD, memory_budget=["3GiB", "1GiB"], lr=0.1)
    step(sharded, optimizer)
    out["sharded step"] = sharded._ensure_engine().allocated_bucket_bytes() / parameters
    owned = [p for i, p in enumerate(sharded.parameters()) if i in optimizer.layout.owned[rank]]
    out["owned"] = sum(p.numel() * p.element_size() for p in owned) / parameters
    return out


def test_buckets_take_memory_from_the_first_gradient_and_only_the_owners_keep_them():
    """Note [Bucket memory]: wrapping allocates no bucket; steps allocate them all (a little more than the
    gradients: slot alignment and flags); with owners, a rank keeps its own buckets only."""
    for rank, out in enumerate(run_ranks(bucket_bytes_over_a_step, 2)):
        assert out["wrapped"] == 0, (rank, out)
        assert 1.0 <= out["whole step"] < 1.5, (rank, out)
        assert 0 < out["owned"] <= out["sharded step"] < out["owned"] + 0.3, (rank, out)


JOIN_SIZES = [[3, 5], [4, 1, 6, 2, 3], [2, 2, 7]]  # rank r's examples per step: rank 0 joins first, rank 1 last
NAN_STEP = 3  # a step whose loss is not finite on one active rank: skipped everywhere


def sharded_under_join(rank: int, world_size: int, micro_steps: int, join: str, nan_step: int = NAN_STEP,
                       clip: bool = True) -> dict[str, torch.Tensor]:
    """AdamW through a ShardedOptimizer (budgets 3:1:2) under Join, with clipping, a schedule and a non-finite
    step: each rank runs its own number of steps, the joined ones shadow the rest."""
    from torch.distributed.algorithms.join import Join

    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32), bucket_cap_mb=TINY_BUCKET_MB)
    cls, kwargs = OPTIMIZERS["adamw"]
    optimizer = hsync.ShardedOptimizer(model, cls, memory_budget=["3GiB", "1GiB", "2GiB"], **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    joined = {"model.join()": model.join, "Join([model, optimizer])": lambda: Join([model, optimizer]),
              "Join([model])": lambda: Join([model])}[join]
    with joined():
        for step, n in enumerate(JOIN_SIZES[rank]):
            sizes = [s[step] if step < len(s) else 0 for s in JOIN_SIZES]
            for micro in range(micro_steps):
                x, y = global_batch(step, sizes, micro, dtype=torch.float32)[2][rank]
                with contextlib.nullcontext() if micro == micro_steps - 1 else model.no_sync():
                    loss = mse(model(x), y) * (math.nan if step == nan_step and rank == 1 else 1.0)
                    stats = model.backward(loss, weight=n)
            if clip:
                norm = optimizer.clip_grad_norm_(0.5)
                assert math.isfinite(norm) == stats.finite, (norm, stats)
            if stats.finite:
                optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    return {name: p.detach() for name, p in model.module.named_parameters()}


def reference_under_join(micro_steps: int, nan_step: int = NAN_STEP, clip: bool = True) -> dict[str, torch.Tensor]:
    """One process over the examples still in play at each step: what every rank's parameters must equal."""
    net = make_net(seed=0, dtype=torch.float32)
    cls, kwargs = OPTIMIZERS["adamw"]
    optimizer = cls(net.parameters(), **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    for step in range(max(len(s) for s in JOIN_SIZES)):
        sizes = [s[step] if step < len(s) else 0 for s in JOIN_SIZES]
        x = torch.cat([global_batch(step, sizes, micro, dtype=torch.float32)[0] for micro in range(micro_steps)])
        y = torch.cat([global_batch(step, sizes, micro, dtype=torch.float32)[1] for micro in range(micro_steps)])
        if step != nan_step:
            mse(net(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in net.named_parameters()}


@pytest.mark.parametrize("micro_steps", [1, 2], ids=["synced", "no_sync"])
@pytest.mark.parametrize("join", ["model.join()", "Join([model, optimizer])"])
def test_under_join_the_joined_ranks_step_their_share_exactly(micro_steps, join):
    """Note [Sharded steps under Join]: ranks that ran out of data still step the parameters they own, with
    the reduced gradient, the others' clipping and their schedule's learning rate; every rank ends with the
    parameters of one process over the examples in play."""
    results = run_ranks(sharded_under_join, 3, micro_steps, join)
    expected = reference_under_join(micro_steps)
    for rank, params in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")


def test_join_without_the_optimizer_is_refused_on_every_rank_before_any_collective():
    for rank, error in enumerate(run_ranks_expecting_errors(sharded_under_join, 3, 1, "Join([model])")):
        assert "so the optimizer joins too, after the model: use model.join(), or Join([model, optimizer])" \
            in error, (rank, error)


LAGGING_LAYER_BYTES = 256 * 256 * 4


def bucket_bytes_while_the_owner_lags(rank: int, world_size: int) -> dict[str, float]:
    """Rank 0 owns most layers and is slow in its backward (a sleep at each layer), so rank 1's reduces to it
    complete late; rank 1 reads the engine's bucket bytes as its backward reaches each layer. In layers."""
    import time

    import hsync

    def in_backward(action: Callable[[], None]) -> Callable:
        def forward_hook(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
            out.register_hook(lambda grad: action())
        return forward_hook

    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256, bias=False) for _ in range(8)]  # a bucket each
    model = hsync.WeightedDDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.125, first_bucket_cap_mb=0.125)
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, memory_budget=["7GiB", "1GiB"], lr=0.1)
    peaks = []
    for layer in layers:
        layer.register_forward_hook(in_backward(lambda: time.sleep(0.05)) if rank == 0 else
                                    in_backward(lambda: peaks.append(model._ensure_engine().allocated_bucket_bytes())))
    for _ in range(3):  # the first rebuilds the buckets in the order gradients came
        peaks.clear()
        x = torch.randn(4, 256)
        model.backward(model(x).square().mean(), weight=len(x))
        optimizer.step()
        optimizer.zero_grad()
    return {"peak": max(peaks, default=0) / LAGGING_LAYER_BYTES, "owned": len(optimizer.layout.owned[rank])}


def test_other_ranks_buckets_take_two_buffers_however_late_their_owner():
    """Note [Owned buckets]: a rank holds its own buckets and two in-flight buffers of others', even when the
    owner completes their reduces long after they were launched (without the bound, every bucket launched and
    not yet reduced would hold its memory: seven layers here)."""
    rank_1 = run_ranks(bucket_bytes_while_the_owner_lags, 2)[1]
    assert rank_1["owned"] < 4, rank_1
    assert rank_1["peak"] <= (rank_1["owned"] + 2) * 1.01, rank_1


def test_a_rank_keeps_no_gradient_memory_of_the_buckets_it_does_not_own():
    """ZeRO-2: another rank's bucket is freed once sent. Unsharded, every rank keeps every gradient's bucket
    (the parameters' bytes again, and what the first steps leave to any run: about 15% here); sharded over two
    equal budgets, each keeps its own half only."""
    from hsync.bench.memory import measurable

    if not measurable(torch.device("cpu")):
        pytest.skip("CPU memory is measured through glibc's mallinfo2, which this C library lacks")
    whole = run_ranks(gradient_bytes_kept, 2, False)
    sharded = run_ranks(gradient_bytes_kept, 2, True)
    for rank, ((kept_whole, parameters), (kept_sharded, _)) in enumerate(zip(whole, sharded, strict=True)):
        assert kept_whole > 0.95 * parameters, (rank, kept_whole / parameters)
        freed = (kept_whole - kept_sharded) / parameters
        assert 0.45 < freed < 0.55, (rank, freed)


SPLITS = {1: [8], 2: [5, 3], 3: [2, 3, 3]}  # the same 8 examples a step, however many ranks


def train_sharded(rank: int, world_size: int, budgets, steps: range, folder: str, resume: str | None = None,
                  save_after: int | None = None) -> dict:
    """AdamW through a ShardedOptimizer over `steps`, from a checkpoint in `folder` if `resume` ("whole": the
    consolidated state, "shards": every rank's own), saving both after step `save_after`."""
    import hsync

    net = make_net(seed=0, dtype=torch.float32)
    if resume:
        net.load_state_dict(torch.load(f"{folder}/model.pt"))
    model = hsync.WeightedDDP(net, bucket_cap_mb=TINY_BUCKET_MB)
    optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, memory_budget=budgets, lr=0.01)
    if resume == "whole":
        optimizer.load_state_dict(torch.load(f"{folder}/optimizer.pt"))
    elif resume == "shards":
        shards = sorted(Path(folder).glob("optimizer-shard-*.pt"))
        optimizer.load_state_dict_shards(torch.load(path) for path in shards)
    for step in steps:
        optimizer.zero_grad()
        _, _, parts = global_batch(step, SPLITS[world_size], dtype=torch.float32)
        x, y = parts[rank]
        model.backward(mse(model(x), y), weight=len(x))
        optimizer.step()
        if step == save_after:
            optimizer.consolidate_state_dict(to=0)
            torch.save(optimizer.state_dict_shard(), f"{folder}/optimizer-shard-{rank}.pt")
            if rank == 0:
                torch.save(optimizer.state_dict(), f"{folder}/optimizer.pt")
                torch.save(model.module.state_dict(), f"{folder}/model.pt")
    owned = {p for i, p in enumerate(optimizer._all) if i in optimizer.layout.owned[rank]}
    return {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
            "state_only_where_owned": all(p in owned for p in optimizer.state)}


def plain_resume(rank: int, world_size: int, steps: range, folder: str) -> dict:
    """The consolidated state in the plain AdamW over one rank's whole model, without hsync's optimizer."""
    import hsync

    net = make_net(seed=0, dtype=torch.float32)
    net.load_state_dict(torch.load(f"{folder}/model.pt"))
    model = hsync.WeightedDDP(net, bucket_cap_mb=TINY_BUCKET_MB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.load_state_dict(torch.load(f"{folder}/optimizer.pt"))
    for step in steps:
        optimizer.zero_grad()
        _, _, parts = global_batch(step, SPLITS[world_size], dtype=torch.float32)
        model.backward(mse(model(parts[rank][0]), parts[rank][1]), weight=len(parts[rank][0]))
        optimizer.step()
    return {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


def test_a_checkpoint_written_on_two_ranks_resumes_on_three_on_one_and_in_the_plain_optimizer(tmp_path):
    folder = str(tmp_path)
    straight = run_ranks(train_sharded, 2, ["3MiB", "1MiB"], range(6), folder, None, 2)
    assert all(r["state_only_where_owned"] for r in straight)
    resumed = {
        "3 ranks, other budgets, whole state": run_ranks(train_sharded, 3, ["1MiB", "2MiB", "1MiB"], range(3, 6),
                                                          folder, "whole"),
        "1 rank, from the shards": run_ranks(train_sharded, 1, None, range(3, 6), folder, "shards"),
        "2 ranks, equal shares, from the shards": run_ranks(train_sharded, 2, None, range(3, 6), folder, "shards"),
        "the plain AdamW": run_ranks(plain_resume, 2, range(3, 6), folder),
    }
    for how, ranks in resumed.items():
        for rank in ranks:
            for name, value in straight[0]["params"].items():
                # Other splits of the same examples sum in another order: equal within float32 rounding.
                torch.testing.assert_close(rank["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"{how}: {name}")


def a_sharded_optimizer_dropped(rank: int, world_size: int) -> dict:
    import gc

    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    x, y = torch.randn(4, 4), torch.zeros(4)
    sharded = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model.backward(mse(model(x), y), weight=4)
    sharded.step()
    del sharded
    gc.collect()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # would step each rank with its own shard's gradients
    with pytest.raises(RuntimeError) as refused:
        model(x)
    again = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)  # sharded anew, it trains on
    model.backward(mse(model(x), y), weight=4)
    again.step()
    del plain
    return {"refused": str(refused.value), "params": [p.detach().clone() for p in model.parameters()]}


def test_a_model_whose_sharded_optimizer_is_gone_refuses_to_train_on_every_rank():
    results = run_ranks(a_sharded_optimizer_dropped, 2)
    for result in results:
        assert "the hsync.ShardedOptimizer that shards this model's gradients" in result["refused"], result["refused"]
        assert "is gone: no reference to it was kept" in result["refused"], result["refused"]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def refused_budgets(rank: int, world_size: int) -> str:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    with pytest.raises(ValueError) as error:
        hsync.ShardedOptimizer(model, torch.optim.AdamW, memory_budget=["1KiB", "2KiB"], lr=0.1)
    return str(error.value)


def test_a_model_too_large_for_the_budgets_is_refused_on_every_rank_naming_each():
    for message in run_ranks(refused_budgets, 2):
        assert message.startswith("hsync.ShardedOptimizer: the model's state does not fit"), message
        assert "rank 0: budget 1.0 KiB" in message and "rank 1: budget 2.0 KiB" in message, message


def bad_arguments(rank: int, world_size: int) -> dict[str, str]:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    hooked = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    hooked.register_comm_hook(None, lambda state, bucket: torch.futures.Future())  # never run here
    def consolidated_state():
        optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=1)
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict()

    errors = {}
    for name, call in {
        "a hooked model": lambda: hsync.ShardedOptimizer(hooked, torch.optim.SGD, lr=1),
        "not a wrapper": lambda: hsync.ShardedOptimizer(model.module, torch.optim.SGD, lr=0.1),
        "not an optimizer class": lambda: hsync.ShardedOptimizer(model, torch.optim.SGD([torch.zeros(1)]), lr=0.1),
        "a stranger parameter": lambda: hsync.ShardedOptimizer(model, torch.optim.SGD, params=[torch.zeros(2)], lr=1),
        "owners after a refusal": lambda: model._attached.param_owners,
        "a budget per rank": lambda: hsync.ShardedOptimizer(model, torch.optim.SGD, memory_budget=["1GiB"], lr=1),
        "state before consolidation": lambda: hsync.ShardedOptimizer(model, torch.optim.SGD, lr=1).state_dict(),
        "state on another rank": consolidated_state,
        # Each owner would step its share with its own rank's learning rate.
        "arguments that differ": lambda: hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1 * (rank + 1)),
        "a hook after sharding": lambda: model.register_comm_hook(None, lambda state, bucket: None),
    }.items():
        try:
            outcome = call()
        except (TypeError, ValueError, RuntimeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
        else:
            errors[name] = outcome
    return errors


def test_bad_arguments_are_refused_naming_the_problem():
    errors = run_ranks(bad_arguments, 2)[1]
    assert "TypeError: hsync.ShardedOptimizer shards a hsync.WeightedDDP's state, got Net" in errors["not a wrapper"]
    assert "optimizer_class must be a torch.optim.Optimizer subclass" in errors["not an optimizer class"]
    assert "1 parameter(s) of a group are not among the wrapped model's" in errors["a stranger parameter"]
    assert "memory_budget lists 1 budget(s) for 2 ranks" in errors["a budget per rank"]
    assert "call consolidate_state_dict(to=rank) on every rank first" in errors["state before consolidation"]
    assert "the state was consolidated on rank 0, not on this rank (1): call state_dict() there" in errors[
        "state on another rank"]
    assert ("ValueError: hsync.ShardedOptimizer: the optimizer's arguments differ across ranks: torch.optim.sgd.SGD("
            "lr=0.1) on rank 0, torch.optim.sgd.SGD(lr=0.2) on rank 1") in errors["arguments that differ"]
    assert "reduces each bucket to the rank that owns its parameters" in errors["a hook after sharding"]
    assert "has a communication hook of the user's" in errors["a hooked model"]
    assert errors["owners after a refusal"] is None  # a refused optimizer leaves the model's reduction alone


class FailsOnRank1(torch.optim.SGD):
    """An optimizer whose step raises on rank 1 alone (as a state loaded from another model does on the ranks
    that own a part of it)."""

    armed = False  # not while hsync measures the state's size at construction

    def step(self, closure=None):
        if self.armed and torch.distributed.get_rank() == 1:
            raise RuntimeError("the size of tensor a (24) must match the size of tensor b (16) (simulated)")
        return super().step(closure)


def a_step_that_raises_on_rank_1(rank: int, world_size: int) -> tuple[str, float]:
    import time

    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    optimizer = hsync.ShardedOptimizer(model, FailsOnRank1, lr=0.1)
    x, y = global_batch(0, [3, 3], dtype=torch.float32)[2][rank]
    model.backward(mse(model(x), y), weight=3)
    FailsOnRank1.armed = True
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        optimizer.step()
    noticed_after = time.monotonic() - started
    if rank == 1:
        time.sleep(6)  # alive: its peer can learn only from its post
    return str(error.value), noticed_after


def test_an_optimizer_step_that_raises_on_one_rank_ends_the_others_at_once_naming_it():
    # Rank 0 waited in the broadcast of rank 1's parameters until the deadline (300 s by default), told only that
    # a peer was slow.
    results = run_ranks(a_step_that_raises_on_rank_1, 2, timeout=60)
    assert results[1][0] == "the size of tensor a (24) must match the size of tensor b (16) (simulated)", results[1]
    error, noticed_after = results[0]
    assert "hsync: rank 1 (gloo): its optimizer step raised RuntimeError: the size of tensor a (24)" in error, error
    assert noticed_after < 5.0, noticed_after


def state_dict_after(rank: int, world_size: int, change: str) -> str:
    """state_dict() on rank 0 after consolidate_state_dict(to=0) and then two steps, or a load."""
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, lr=0.1)
    optimizer.consolidate_state_dict(to=0)
    for step in range(2 if change == "steps" else 0):
        x, y = global_batch(step, [2] * world_size, dtype=torch.float32)[2][rank]
        model.backward(mse(model(x), y), weight=2)
        optimizer.step()
    if change == "load":
        optimizer.load_state_dict_shards([optimizer.state_dict_shard()])  # this rank's part alone: one is enough
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        return str(error)
    return "handed out"


@pytest.mark.parametrize("change", ["steps", "load"])
def test_a_state_consolidated_before_a_step_or_a_load_is_not_handed_out(change):
    # ZeroRedundancyOptimizer's state_dict() hands out the state of its last consolidation, however many steps
    # ago: a checkpoint silently behind its model.
    message = run_ranks(state_dict_after, 2, change)[0]
    assert "the state was consolidated before the last step() or load_state_dict()" in message, message


PLAIN_JOIN_STEPS = (2, 4)  # rank r's plain steps under Join: rank 0 joins after two


def plain_join_slices(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's examples in `step` (none once it has joined)."""
    return global_batch(step, [4 if step < steps else 0 for steps in PLAIN_JOIN_STEPS], dtype=torch.float32)[2]


def plain_steps_under_join(rank: int, world_size: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Plain loss.backward() steps through a ShardedOptimizer (budgets 3:1) under model.join(): DDP's
    arithmetic (the sum of the active ranks' gradients over the world size), the joined rank shadowing."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32).to(device), bucket_cap_mb=TINY_BUCKET_MB)
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, memory_budget=["3GiB", "1GiB"], lr=0.1,
                                       momentum=0.9)
    with model.join():
        for step in range(PLAIN_JOIN_STEPS[rank]):
            x, y = (t.to(device) for t in plain_join_slices(step)[rank])
            mse(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach().cpu() for name, p in model.module.named_parameters()}


def reference_plain_under_join() -> dict[str, torch.Tensor]:
    net = make_net(seed=0, dtype=torch.float32)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # unlike Adam, it sees a wrong scale
    for step in range(max(PLAIN_JOIN_STEPS)):
        active = [(x, y) for x, y in plain_join_slices(step) if len(x)]
        (sum(mse(net(x), y) for x, y in active) / len(PLAIN_JOIN_STEPS)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in net.named_parameters()}


def test_plain_steps_under_join_step_as_ddp_would():
    # The step scalars of a plain step are read too (whether it was finite), which a GPU copies to the host apart.
    results = run_ranks(plain_steps_under_join, 2)
    expected = reference_plain_under_join()
    for rank, params in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")


def state_held_with_parameters_outside_the_groups(rank: int, world_size: int) -> tuple[int, int]:
    """A ShardedOptimizer over the last four of eight layers (budgets 3:1), the user's SGD over the first four:
    what the layout says this rank needs between steps (without the buckets a backward holds in flight), and what
    it holds after two steps (parameters, gradient buckets, the .grad tensors beside them, this optimizer's
    state)."""
    import hsync
    from hsync.balance.memory import StateBytes

    model = hsync.WeightedDDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]),
                              bucket_cap_mb=64 * 65 * 4 / 2**20)  # a layer a bucket: little in flight
    layers = list(model.module)
    optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, memory_budget=["3MiB", "1MiB"],
                                       params=[p for layer in layers[4:] for p in layer.parameters()])
    others = torch.optim.SGD([p for layer in layers[:4] for p in layer.parameters()], lr=0.1)
    for _ in range(2):
        x = torch.randn(4, 64)
        model.backward(model(x).square().mean(), weight=len(x))
        optimizer.step()
        others.step()

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    held = (size(model.parameters()) + model._ensure_engine().allocated_bucket_bytes()
            + size(p.grad for p in model.parameters() if p.grad is not None)
            + size(t for state in optimizer.state.values() for t in state.values() if t.dim() > 0))
    in_flight = StateBytes(model, torch.optim.AdamW, {}).in_flight([p.numel() * 4 for p in model.parameters()])
    return optimizer.layout.needs[rank] - in_flight, held


def test_the_layout_counts_the_gradients_of_parameters_outside_the_groups_on_every_rank():
    # Those gradients are whole on every rank; the layout gave them a nominal owner instead, which counted them
    # there with optimizer state this optimizer does not keep, and not on the other rank.
    for rank, (need, held) in enumerate(run_ranks(state_held_with_parameters_outside_the_groups, 2)):
        # Within 1%: the buckets' flags and slot alignment are not counted.
        assert abs(held - need) <= 0.01 * need, f"rank {rank} holds {held} bytes between steps, its layout: {need}"


def a_budget_only_one_rank_refuses(rank: int, world_size: int) -> list[str]:
    """Budgets that only rank 1's own parse refuses: its entry of a list, and a size of its own."""
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32))
    errors = []
    for budget in (["1GiB", "bogus"], "1GiB" if rank == 0 else "-5"):
        try:
            hsync.ShardedOptimizer(model, torch.optim.SGD, memory_budget=budget, lr=0.1)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_a_budget_only_one_rank_refuses_is_refused_on_every_rank():
    # Rank 0 was told only that its peer had exited (the refusal came before the budgets' gather).
    for errors in run_ranks(a_budget_only_one_rank_refuses, 2):
        assert errors == [
            "memory_budget[1]: cannot read 'bogus' as a size (for example '6GiB', '512MB' or 1e9) (rank 1; refused on "
            "ranks [1])",
            "memory_budget must be a positive, finite size of at least one byte, got '-5' (rank 1; refused on ranks "
            "[1])"], errors
