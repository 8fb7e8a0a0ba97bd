"""Models whose backward passes exchange gradients between ranks (SyncBatchNorm; any layer or loss
built on differentiable collectives): weighted steps stay exact against a single process that
normalises over the concatenated global batch."""

import contextlib
import time

import pytest
import torch
from torch import nn

from tests.distributed.workloads import global_batch
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

# steps[s][micro][rank]: one step, then a window of two micro-steps; every rank runs each forward.
STEPS = [[[3, 7, 2]], [[1, 4, 2], [3, 2, 5]]]


def batch_norm_over(x: torch.Tensor, sums: torch.Tensor, eps: float) -> torch.Tensor:
    """x normalised by the mean and (biased) variance that `sums` = [sum x, sum x^2, count] describe."""
    width = x.shape[1]
    mean = sums[:width] / sums[-1]
    var = sums[width:2 * width] / sums[-1] - mean ** 2
    return (x - mean) * torch.rsqrt(var + eps)


def global_sums(x: torch.Tensor) -> torch.Tensor:
    """[sum x, sum x^2, count] over every rank's x, through a differentiable all-reduce: in backward,
    each rank's gradient reaches every other rank, as in torch's SyncBatchNorm."""
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), x.shape[0])]))


class CpuSyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm in training, on the CPU (torch's needs a GPU): found by type, as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_norm_over(x, global_sums(x), self.eps) * self.weight + self.bias


class GlobalNorm(nn.Module):
    """The same normalisation in a layer of one's own, which no wrapper can recognise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_norm_over(x, global_sums(x), 1e-5) * self.scale


class LocalNorm(nn.Module):
    """GlobalNorm's twin for one process holding the whole global batch."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), x.shape[0])])
        weight = self.norm.weight if isinstance(self.norm, nn.SyncBatchNorm) else self.norm.scale
        bias = self.norm.bias if isinstance(self.norm, nn.SyncBatchNorm) else 0.0
        return batch_norm_over(x, sums, 1e-5) * weight + bias


def make_model(norm: str, device: str = "cpu") -> nn.Sequential:
    """On a GPU, with torch's own SyncBatchNorm."""
    torch.manual_seed(0)
    sync_batch_norm = nn.SyncBatchNorm if device == "cuda" else CpuSyncBatchNorm
    layer = sync_batch_norm(6).double() if norm == "sync-batch-norm" else GlobalNorm(6)
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(0.5, 1.5)
    return nn.Sequential(nn.Linear(4, 6, dtype=torch.float64), layer, nn.Tanh(),
                         nn.Linear(6, 1, dtype=torch.float64), nn.Flatten(0)).to(device)


def sum_of_squares(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).sum()


def weighted_steps(rank: int, world_size: int, norm: str, device: str = "cpu", views: bool = False,
                   bucket_cap_mb: float | None = None) -> list[dict[str, torch.Tensor]]:
    """With views (gradient_as_bucket_view), the CPU scales before the sum, as a GPU does (Note
    [Deferred normalisation] in csrc/engine.h)."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    flag = {} if norm == "sync-batch-norm" else {"cross_rank_backward": True}
    model = hsync.WeightedDDP(make_model(norm, device), gradient_as_bucket_view=views, bucket_cap_mb=bucket_cap_mb,
                              **flag)
    return [weighted_step(model, rank, step, device) for step in range(len(STEPS))]


def weighted_step(model, rank: int, step: int, device: str) -> dict[str, torch.Tensor]:
    """STEPS[step] on this rank: its micro-steps, the last synchronised; the gradients, zeroed after."""
    micro_steps = STEPS[step]
    for micro, sizes in enumerate(micro_steps):
        x, y = (t.to(device) for t in global_batch(step, sizes, micro)[2][rank])
        with model.no_sync() if micro < len(micro_steps) - 1 else contextlib.nullcontext():
            model.backward(sum_of_squares(model(x), y) / len(x), weight=len(x))
    grads = {name: p.grad.to("cpu", copy=True) for name, p in model.module.named_parameters()}
    model.zero_grad()
    return grads


def steps_until_a_rank_runs_out(rank: int, world_size: int, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """weighted_steps under join(throw_on_early_termination=True), the last rank holding one step fewer: no rank
    shadows a forward of its peers', every rank raises at the first forward after that rank ran out (as under
    DDP), and the steps before are exact."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    model = hsync.WeightedDDP(make_model("sync-batch-norm", device))
    last = rank == world_size - 1
    steps = len(STEPS) - 1 if last else len(STEPS)
    grads = []
    expected = f"Rank {rank} exhausted all inputs" if last else "Detected at least one rank that exhausted inputs"
    with pytest.raises(RuntimeError, match=expected), model.join(throw_on_early_termination=True):
        for step in range(steps):
            grads.append(weighted_step(model, rank, step, device))
    return grads


def reference_steps(norm: str) -> list[dict[str, torch.Tensor]]:
    """The gradient of the mean squared error over every example of the step, in one process."""
    model = make_model(norm)
    model[1] = LocalNorm(model[1])
    grads = []
    for step, micro_steps in enumerate(STEPS):
        total = sum(sum(sizes) for sizes in micro_steps)
        for micro, sizes in enumerate(micro_steps):
            x, y, _ = global_batch(step, sizes, micro)
            (sum_of_squares(model(x), y) / total).backward()
        grads.append({name.replace("1.norm.", "1."): p.grad.clone() for name, p in model.named_parameters()})
        model.zero_grad()
    return grads


def check_against_one_process(results: list, norm: str) -> None:
    expected = reference_steps(norm)
    for rank, grads in enumerate(results):
        torch.testing.assert_close(grads, expected, rtol=1e-10, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.parametrize(("norm", "views"), [("sync-batch-norm", False), ("sync-batch-norm", True),
                                            ("a-layer-of-ones-own", False)])
def test_weighted_steps_through_a_cross_rank_backward_match_one_process(norm, views):
    check_against_one_process(run_ranks(weighted_steps, 3, norm, "cpu", views), norm)


def test_a_join_that_throws_on_early_termination_runs_weighted_steps_through_a_cross_rank_backward():
    results = run_ranks(steps_until_a_rank_runs_out, 3)
    expected = reference_steps("sync-batch-norm")[:len(STEPS) - 1]
    for rank, grads in enumerate(results):
        torch.testing.assert_close(grads, expected, rtol=1e-10, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


def disagreeing_flag(rank: int, world_size: int) -> str:
    import hsync

    with pytest.raises(RuntimeError) as error:
        hsync.WeightedDDP(make_model("a-layer-of-ones-own"), cross_rank_backward=rank == 1)
    return str(error.value)


def test_ranks_that_disagree_on_cross_rank_backward_are_refused():
    for message in run_ranks(disagreeing_flag, 2):
        assert "cross_rank_backward differs across ranks: False on rank 0, True on rank 1" in message



def wrapped_sync_batch_norm_model(converted_after_the_wrap: bool = False):
    """make_model("sync-batch-norm") in a WeightedDDP; `converted_after_the_wrap`: wrapped with a plain BatchNorm1d
    in the norm's place, and the norm put in after, over the same parameters, as torch's convert_sync_batchnorm
    run on the wrapped model does (DDP's documentation asks for it before the wrap)."""
    import hsync

    module = make_model("sync-batch-norm")
    if not converted_after_the_wrap:
        return hsync.WeightedDDP(module)
    sync = module[1]
    plain = nn.BatchNorm1d(6).double()
    plain.weight, plain.bias = sync.weight, sync.bias
    module[1] = plain
    model = hsync.WeightedDDP(module)
    module[1] = sync
    return model


def converted_after_the_wrap(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    model = wrapped_sync_batch_norm_model(converted_after_the_wrap=True)
    return [weighted_step(model, rank, step, "cpu") for step in range(len(STEPS))]


def test_a_sync_batch_norm_converted_in_after_the_wrap_keeps_weighted_steps_exact():
    # Was inexact: each rank's gradient expressed in a weight of its own, through a backward that mixes them.
    check_against_one_process(run_ranks(converted_after_the_wrap, 3), "sync-batch-norm")


def balanced_steps(rank: int, world_size: int, examples: int, limit: int | None,
                   late: bool = False) -> str | list[torch.Tensor]:
    """hsync.Balancer over a SyncBatchNorm model (`late`: converted in after the wrap): the first step's
    gradients, or the error that stopped it."""
    import hsync

    model = wrapped_sync_batch_norm_model(converted_after_the_wrap=late)
    x_all, y_all, _ = global_batch(0, [examples])
    config = hsync.BalanceConfig(global_batch_size=12, rank_batch_sizes=[6, 4, 2],
                                 micro_batch_limit=[limit, None, None], shuffle=False)
    try:
        balancer = hsync.Balancer(model, examples, config)
        for indices in balancer:
            if balancer.backward(sum_of_squares(model(x_all[indices]), y_all[indices]) / len(indices)):
                return {name: p.grad for name, p in model.module.named_parameters()}
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError("no step completed")


def test_a_balancer_runs_every_rank_in_lockstep_or_says_why_it_cannot():
    runs = {name: run_ranks(balanced_steps, 3, examples, limit, late, timeout=60)
            for name, examples, limit, late in (("lockstep", 24, None, False),
                                                ("more micro-batches on rank 0", 24, 2, False),
                                                ("a last step too small", 25, None, False),
                                                ("a last step too small, converted late", 25, None, True))}
    # Unshuffled, the first step is the first 12 examples: the gradient of their mean, normalised together.
    model = make_model("sync-batch-norm")
    model[1] = LocalNorm(model[1])
    x, y, _ = global_batch(0, [24])
    (sum_of_squares(model(x[:12]), y[:12]) / 12).backward()
    expected = {name.replace("1.norm.", "1."): p.grad for name, p in model.named_parameters()}
    for grads in runs["lockstep"]:
        torch.testing.assert_close(grads, expected, rtol=1e-10, atol=1e-12)
    for error in runs["more micro-batches on rank 0"]:  # found on every rank, before the step's forward
        assert error.startswith("RuntimeError: hsync.Balancer: step 0 would give the ranks [3, 1, 1] micro-batches")
    for error in runs["a last step too small"] + runs["a last step too small, converted late"]:  # before training
        assert error.startswith("ValueError: hsync.Balancer: a step of size 1 would leave a rank without an example")


def bad_input_on_one_rank(rank: int, world_size: int) -> list[str]:
    import hsync

    model = hsync.WeightedDDP(make_model("sync-batch-norm"))
    x, y = global_batch(0, [3, 3, 3])[2][rank]
    errors = []
    for weight in (-1.0 if rank == 1 else 3.0, "three" if rank == 2 else 3.0):
        with pytest.raises(ValueError) as error:
            model.backward(sum_of_squares(model(x), y) / 3, weight=weight)
        errors.append(str(error.value))
    from torch.distributed.algorithms.join import Join

    with model.join(enable=False):  # a loop that always wraps its epoch in join, with it off
        model.backward(sum_of_squares(model(x), y) / 3, weight=3)
    with pytest.raises(RuntimeError) as error, Join([model]):  # torch's Join, not only the wrapper's
        model(x)
    return [*errors, str(error.value)]


def test_bad_input_through_a_cross_rank_backward_is_refused_on_every_rank_without_a_hang():
    # The rank with the bad weight still takes part in backward's collectives (SyncBatchNorm's).
    for negative, not_a_number, join in run_ranks(bad_input_on_one_rank, 3, timeout=60):
        assert "rank 1 passed a weight that is negative, NaN, infinite or above 2**53" in negative, negative
        assert "rank 2 passed" in not_a_number and "weight" in not_a_number, not_a_number
        assert "under Join: a joined rank cannot shadow forwards and backwards that are collectives" in join


def a_loss_without_grad_on_rank_1(rank: int, world_size: int) -> str:
    import hsync

    model = hsync.WeightedDDP(make_model("sync-batch-norm"))
    x, y = global_batch(0, [3, 3, 3])[2][rank]
    with torch.no_grad() if rank == 1 else contextlib.nullcontext():
        loss = sum_of_squares(model(x), y) / 3
    with pytest.raises((ValueError, RuntimeError)) as error:
        model.backward(loss, weight=3)
    return f"{error.type.__name__}: {error.value}"


def test_a_loss_without_grad_through_a_cross_rank_backward_fails_every_rank():
    # Rank 1 cannot run its part of SyncBatchNorm's backward. It raises before any collective of
    # hsync's, which would meet its peers' SyncBatchNorm collectives (a gloo abort, or numbers mixed
    # up); they fail once it exits, as DDP's peers do when its loss.backward() raises.
    errors = run_ranks(a_loss_without_grad_on_rank_1, 3, timeout=60)
    assert errors[1].startswith("ValueError: hsync: rank 1's loss (a torch.float64 tensor of shape ()) does not "
                                "require a gradient"), errors[1]
    for rank in (0, 2):  # in SyncBatchNorm's backward: gloo's connection to rank 1 ends when rank 1 exits
        assert errors[rank].startswith("RuntimeError: ") and "by peer" in errors[rank], errors[rank]


def a_backward_that_raises_on_rank_1(rank: int, world_size: int, layer: int) -> tuple[str, float]:
    import hsync

    model = hsync.WeightedDDP(make_model("sync-batch-norm"))
    if rank == 1:
        def out_of_memory(grad: torch.Tensor) -> None:
            raise RuntimeError("out of memory (simulated)")

        model.module[layer].weight.register_hook(out_of_memory)
    x, y = global_batch(0, [3, 3, 3])[2][rank]
    loss = sum_of_squares(model(x), y) / 3
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        model.backward(loss, weight=3)
    noticed_after = time.monotonic() - started
    if rank == 1 and layer == 0:
        time.sleep(6)  # alive: its peers can learn only from its post
    return str(error.value), noticed_after


@pytest.mark.parametrize("layer", [0, 3], ids=["after-the-norms-collectives", "before-them"])
def test_a_backward_that_raises_through_a_cross_rank_backward_ends_the_step_on_every_rank(layer):
    # Rank 1 runs none of the step's collectives: they could meet its peers' SyncBatchNorm
    # collectives (before the norm's backward: a gloo abort, and a hang). It gives up and posts why.
    results = run_ranks(a_backward_that_raises_on_rank_1, 3, layer, timeout=60)
    assert results[1][0] == "out of memory (simulated)", results[1]
    for rank in (0, 2):
        error, noticed_after = results[rank]
        if layer == 0:  # waiting in hsync's collectives: told by the post
            assert f"hsync: rank {rank} (gloo): stopped waiting for" in error, error
            assert ("a peer failed first. hsync: rank 1 (gloo): backward raised RuntimeError: out of memory "
                    "(simulated). With cross_rank_backward") in error, error
        else:  # waiting in SyncBatchNorm's backward: gloo's connection to rank 1 ends when rank 1 exits
            assert "by peer" in error, error  # "Connection closed by peer", or "reset by peer"
        assert noticed_after < 5.0, error
