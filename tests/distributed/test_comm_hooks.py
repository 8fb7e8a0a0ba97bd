"""Communication hooks of the user's own (Note [Communication hooks]): weighted steps through a hook against
one process, PowerSGD beside DDP's, torch's compression wrappers around a hook, and hooks that fail."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from tests.spawn import run_ranks, run_ranks_expecting_errors

pytestmark = pytest.mark.distributed

SHARES = [24, 8]  # examples per rank and step


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x = torch.randn(sum(SHARES), 6, generator=g)
        batches.append((x, x.sum(1, keepdim=True).sin()))
    return batches


def mean_allreduce_hook(state, bucket):
    """A hook of the user's own, written as DDP's allreduce_hook is: the sum over ranks of buffer / world size."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def rows(rank: int) -> slice:
    return slice(sum(SHARES[:rank]), sum(SHARES[:rank + 1]))


HOOKS = {
    "allreduce": lambda: (None, mean_allreduce_hook),
    "fp16-wrapped": lambda: (None, default_hooks.fp16_compress_wrapper(mean_allreduce_hook)),
    "bf16-wrapped": lambda: (None, default_hooks.bf16_compress_wrapper(mean_allreduce_hook)),
}


def weighted_steps(rank: int, world_size: int, hook: str, views: bool, micro: bool,
                   device: str = "cpu") -> list[torch.Tensor]:
    import hsync

    model = hsync.WeightedDDP(net().to(device), bucket_cap_mb=0.001, gradient_as_bucket_view=views)  # several buckets
    model.register_comm_hook(*HOOKS[hook]())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data(3):
        x, y = x[rows(rank)].to(device), y[rows(rank)].to(device)
        if micro:  # this rank's share in two micro-batches, the first under no_sync
            half = len(x) // 2
            with model.no_sync():
                model.backward(nn.functional.mse_loss(model(x[:half]), y[:half]), weight=half)
            x, y = x[half:], y[half:]
        model.backward(nn.functional.mse_loss(model(x), y), weight=len(x))
        optimizer.step()
        optimizer.zero_grad(set_to_none=not views)
    return [p.detach().cpu().clone() for p in model.parameters()]


def one_process(steps: int) -> list[torch.Tensor]:
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data(steps):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(("hook", "views", "micro"), [
    ("allreduce", False, False), ("allreduce", True, True), ("fp16-wrapped", False, False),
    ("bf16-wrapped", False, False)],
    ids=["allreduce", "allreduce-views-micro-batches", "fp16-wrapped", "bf16-wrapped"])
def test_weighted_steps_through_a_users_hook_equal_one_process(hook, views, micro):
    # 24 + 8 examples: the hook divides by the world size, the pack scaled by world_size * n_r / N.
    expected = one_process(3)
    # Each rank's values rounded once to 16 bits on the way (bfloat16 keeps 8 bits of mantissa).
    tolerance = {"fp16-wrapped": dict(rtol=2e-3, atol=2e-3), "bf16-wrapped": dict(rtol=2e-2, atol=1e-2)}.get(
        hook, dict(rtol=1e-5, atol=1e-6))
    for params in run_ranks(weighted_steps, 2, hook, views, micro):
        for ours, theirs in zip(params, expected, strict=True):
            torch.testing.assert_close(ours, theirs, **tolerance)


STEPS = 40


def powersgd_training(rank: int, world_size: int, weighted: bool) -> dict[str, list[float]]:
    """The same training under DDP and WeightedDDP with PowerSGD (rank 1, error feedback, warm start): each
    wrapper's losses over the whole batch, step by step."""
    import hsync

    losses = {}
    for name in ("ddp", "hsync"):
        wrapper = DistributedDataParallel if name == "ddp" else hsync.WeightedDDP
        model = wrapper(net())
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       min_compression_rate=0.5, random_seed=0)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        whole = []
        x, y = data(1)[0]  # one batch, over and over: a task the net can fit
        for _ in range(STEPS):
            part = rows(rank) if weighted else slice(rank * 16, (rank + 1) * 16)
            loss = nn.functional.mse_loss(model(x[part]), y[part])
            if name == "hsync" and weighted:
                model.backward(loss, weight=len(x[part]))
            else:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                whole.append(nn.functional.mse_loss(model.module(x), y).item())
        losses[name] = whole
        # Freed here, on this thread: left to the garbage collector, DDP's wrapper was once collected inside a
        # PowerSGD callback on one of gloo's threads, during the next wrapper's steps, and its rank ended with
        # "terminate called ... Resource deadlock avoided" (a thread joining itself) while its peer waited.
        del model, optimizer
        gc.collect()
    return losses


def test_powersgd_steps_as_under_ddp_and_weighs_exactly():
    # PowerSGD (rank 1, error feedback) approximates the step's gradient, but every stage of it is linear in
    # the ranks' packed gradients: with equal shares hsync's steps are DDP's, and with 24 + 8 weighted they
    # are the same again, since world_size * n_r / N * g_r sum to the same as with 16 + 16. DDP's own 24 + 8
    # run (a mean of the two ranks' means) drifts away from them.
    equal = run_ranks(powersgd_training, 2, False, timeout=120)[0]
    weighted = run_ranks(powersgd_training, 2, True, timeout=120)[0]
    assert equal["hsync"][-1] < 0.7 * equal["hsync"][0], equal["hsync"]  # it learns (0.42 to 0.26, measured)
    assert equal["hsync"] == pytest.approx(equal["ddp"], rel=1e-4)
    assert weighted["hsync"] == pytest.approx(equal["hsync"], rel=1e-3)
    assert weighted["ddp"][-1] > 1.05 * weighted["hsync"][-1], (weighted["ddp"][-1], weighted["hsync"][-1])


def failing_hook(rank: int, world_size: int, how: str) -> None:
    import hsync

    model = hsync.WeightedDDP(net())

    def raising(state, bucket):
        raise ValueError("the hook's own error")

    def wrong_size(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer()[:3].clone())
        return future

    model.register_comm_hook(None, raising if how == "raises" else wrong_size)
    x, y = data(1)[0]
    model.backward(nn.functional.mse_loss(model(x[rows(rank)]), y[rows(rank)]), weight=SHARES[rank])


@pytest.mark.parametrize(("how", "message"), [
    ("raises", "the hook's own error"), ("wrong-size", "the communication hook returned 3 values for bucket 0")])
def test_a_failing_hook_is_one_clear_error_on_every_rank(how, message):
    for error in run_ranks_expecting_errors(failing_hook, 2, how, timeout=60):
        assert message in error, error


def register_a_string(rank: int, world_size: int) -> None:
    import hsync

    hsync.WeightedDDP(net()).register_comm_hook(None, "allreduce")


def test_a_hook_that_is_not_callable_is_refused_on_every_rank():
    for error in run_ranks_expecting_errors(register_a_string, 2, timeout=60):
        assert "Communication hook must be callable. register_comm_hook takes hook(state, bucket), got" in error, error


def zero_overlap_hook(rank: int, world_size: int) -> None:
    from types import SimpleNamespace

    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import hsync

    # torch builds the hook on NCCL only (gloo may hang in its overlap): it is asked here as on NCCL.
    model = hsync.WeightedDDP(net())
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    ddp_zero_hook.dist = SimpleNamespace(**{**vars(dist), "get_backend": lambda group: dist.Backend.NCCL})
    try:
        hook = ddp_zero_hook.hook_with_zero_step(default_hooks.allreduce_hook, model, zero)
    finally:
        ddp_zero_hook.dist = dist
    model.register_comm_hook(None, hook)


def test_zero_overlapped_with_ddps_buckets_is_refused_naming_the_sharded_optimizer():
    # DDP's hook reads DDP's reducer from inside the backward; hsync's engine has none.
    for error in run_ranks_expecting_errors(zero_overlap_hook, 2, timeout=60):
        assert "torch's hook_with_zero_step overlaps a ZeroRedundancyOptimizer" in error, error
        assert "hsync.ShardedOptimizer(model, optimizer_class, ...)" in error, error


def hooks_that_differ(rank: int, world_size: int) -> None:
    import hsync

    # Rank 0 a hook of its own, rank 1 torch's allreduce_hook (hsync's fast path): their buckets would travel
    # differently (hsync all-reduces only its flags beside a user's hook), so neither may step.
    hook = mean_allreduce_hook if rank == 0 else default_hooks.allreduce_hook
    hsync.WeightedDDP(net()).register_comm_hook(None, hook)


def test_a_users_hook_on_some_ranks_only_is_refused_on_every_rank():
    for error in run_ranks_expecting_errors(hooks_that_differ, 2, timeout=60):
        assert "communication_hook differs across ranks: the user's on rank 0, hsync's on rank 1" in error, error


def uneven_net() -> nn.Module:
    """Layers of very different sizes: with a small cap, buckets of different sizes (Note [Hook order])."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 96), nn.Tanh(), nn.Linear(96, 48), nn.Tanh(), nn.Linear(48, 8), nn.Tanh(),
                         nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))


def jittered(hook, rank: int):
    """`hook` with a pause of its own on each rank before its future completes, different at every call: the
    threads' timing differs between ranks as under load."""
    pauses = torch.Generator().manual_seed(100 + rank)

    def run(state, bucket):
        def later(future):
            time.sleep(float(torch.rand((), generator=pauses)) * 0.004)
            return future.value()

        return hook(state, bucket).then(later)

    return run


def hooked_steps_in_any_timing(rank: int, world_size: int, which: str, steps: int,
                               device: str = "cpu") -> tuple[list[torch.Tensor], int]:
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    model = hsync.WeightedDDP(uneven_net().to(device), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    if which == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       min_compression_rate=0.5, random_seed=0)
        model.register_comm_hook(state, jittered(powersgd.powerSGD_hook, rank))
    else:
        model.register_comm_hook(None, jittered(mean_allreduce_hook, rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        n = 3 + (rank + step) % 5  # shares that differ from step to step
        x = torch.randn(n, 6, generator=g).to(device)
        if step % 3 == 2:
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
            loss.backward()  # a plain step among the weighted ones
        else:
            model.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()), weight=n)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().cpu().clone() for p in model.parameters()], len(model.bucket_params)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("which", ["powersgd", "allreduce"])
def test_hooked_buckets_keep_one_order_of_collectives_whatever_the_timing(which, world_size):
    # Once, the hooks' collectives and hsync's reached gloo in other orders on the two ranks, and the job
    # aborted ("Received data size doesn't match expected size"). The fingerprints compare every collective of
    # hsync's across ranks before it runs, from the threads that complete the hooks' futures too.
    results = run_ranks(hooked_steps_in_any_timing, world_size, which, 30, timeout=150,
                        env={"HSYNC_DEBUG_COLLECTIVES": "1"})
    buckets = results[0][1]
    assert buckets >= 4, f"only {buckets} buckets: the case needs several"
    for params, _ in results[1:]:
        for ours, theirs in zip(params, results[0][0], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def annotated_mean_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """mean_allreduce_hook, annotated as DDP asks, in a module whose annotations are postponed (strings)."""
    return mean_allreduce_hook(state, bucket)


def annotated_wrongly(state: object, bucket: dist.ProcessGroup) -> torch.futures.Future[torch.Tensor]:
    return mean_allreduce_hook(state, bucket)


def postponed_annotations(rank: int, world_size: int) -> dict[str, str]:
    import hsync

    outcomes = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("hsync", hsync.WeightedDDP)):
        for hook in (annotated_mean_hook, annotated_wrongly):
            try:
                wrap(net()).register_comm_hook(None, hook)
                outcomes[f"{name}, {hook.__name__}"] = "registered"
            except ValueError as error:
                outcomes[f"{name}, {hook.__name__}"] = str(error)
    return outcomes


def test_a_hooks_postponed_annotations_are_checked_as_what_they_name():
    # DDP compares the strings themselves with the types, and refuses a right annotation; hsync evaluates them.
    for outcomes in run_ranks(postponed_annotations, 2):
        assert outcomes["hsync, annotated_mean_hook"] == "registered"
        assert outcomes["hsync, annotated_wrongly"].startswith("Communication hook: bucket annotation should be "
                                                               "dist.GradBucket. (on rank 0)")
        assert outcomes["ddp, annotated_mean_hook"] == "Communication hook: bucket annotation should be " \
                                                      "dist.GradBucket."


def per_gradient_hook(state, bucket):  # no annotations: DDP checks them, and this file postpones them
    """A hook that reads buffer() as DDP lays it out, the bucket's gradients end to end (it splits it by their
    sizes), and normalises each gradient before the mean; it records each bucket's number of gradients."""
    sizes = [g.numel() for g in bucket.gradients()]
    state.append((bucket.index(), len(sizes)))
    for piece in torch.split(bucket.buffer(), sizes):  # refused unless the sizes add up to the buffer's
        piece.div_(piece.norm() + 1e-3)
    return mean_allreduce_hook(None, bucket)


def steps_through_a_layout_reading_hook(rank: int, world_size: int) -> dict[str, tuple]:
    import hsync

    done = {}
    for name, wrapper in (("ddp", DistributedDataParallel), ("hsync", hsync.WeightedDDP)):
        torch.manual_seed(0)  # a 1-element bias (hsync's slots were padded to 16 bytes), and layers of 1 MiB
        model = wrapper(nn.Sequential(nn.Linear(6, 512), *(nn.Linear(512, 512) for _ in range(3)), nn.Linear(512, 1)),
                        bucket_cap_mb=2)
        buckets = []
        model.register_comm_hook(buckets, per_gradient_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data(3):
            part = slice(rank * 16, (rank + 1) * 16)
            nn.functional.mse_loss(model(x[part]), y[part]).backward()
            optimizer.step()
            optimizer.zero_grad()
        last_step = buckets[-len(buckets) // 3:]  # each step hooks the same number of buckets
        done[name] = ([p.detach().clone() for p in model.parameters()], sorted(last_step))
    return done


def test_a_hook_reads_the_bucket_as_ddp_lays_it_out():
    # Each gradient's slot began at a 16-byte boundary: a hook that split buffer() by the gradients' sizes failed,
    # one that cut it by their sum normalised the wrong elements, silently; and an explicit bucket_cap_mb left the
    # first bucket at 1 MiB, where DDP takes the cap for it too (another number of buckets, seen by the hook).
    for done in run_ranks(steps_through_a_layout_reading_hook, 2, timeout=120):
        (ddp_params, ddp_buckets), (params, buckets) = done["ddp"], done["hsync"]
        assert buckets == ddp_buckets
        for ours, theirs in zip(params, ddp_params, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
