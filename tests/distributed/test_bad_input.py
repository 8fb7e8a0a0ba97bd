"""Bad input raises a clear error on every rank, never a hang, and the next good step still works."""

import contextlib
import datetime
import math
import re
import time

import pytest
import torch
from torch import nn

from tests.distributed.workloads import global_batch, make_net, mse
from tests.spawn import run_ranks, run_ranks_expecting_errors

pytestmark = [pytest.mark.distributed, pytest.mark.quick]


def bad_step_then_good_step(rank: int, world_size: int, bad: dict) -> tuple[str, float]:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0), metric_names=("ok",))
    _, _, slices = global_batch(0, [4] * world_size)
    x, y = slices[rank]
    loss, weight, metrics = mse(model(x), y), 4, None
    if rank == 1:
        loss = bad.get("loss", loss)
        weight = bad.get("weight", weight)
        metrics = bad.get("metrics")
    with model.no_sync():  # a micro-batch before it, whose gradient the refused step drops too
        model.backward(mse(model(x), y), weight=4)
    try:
        model.backward(loss, weight=weight, metrics=metrics)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: no error for {bad}")
    assert all(p.grad is None for p in model.module.parameters()), f"rank {rank}: the refused step left gradients"
    stats = model.backward(mse(model(x), y), weight=4)  # no zero_grad(): nothing is left to add to
    after = [p.grad for p in model.module.parameters()]
    model.module.zero_grad(set_to_none=True)
    model.backward(mse(model(x), y), weight=4)
    for a, p in zip(after, model.module.parameters(), strict=True):
        assert (a is None and p.grad is None) or torch.equal(a, p.grad), (
            f"rank {rank}: the next good step's gradients are not those of the same step from none")
    return message, stats.weight


@pytest.mark.parametrize(
    ("bad", "shared", "own"),
    [
        ({"weight": -1.0}, "rank 1 passed a weight that is negative, NaN, infinite or above 2**53", "got -1.0"),
        ({"weight": math.nan}, "rank 1 passed a weight that is negative, NaN, infinite or above 2**53", "got nan"),
        ({"weight": math.inf}, "rank 1 passed a weight that is negative, NaN, infinite or above 2**53", "got inf"),
        ({"weight": torch.tensor(-2.0)}, "rank 1 passed a weight that is negative, NaN, infinite or above 2**53", None),
        # Its gradients, scaled by it on the CPU, overflowed float32 while the step read as finite.
        ({"weight": 1e36}, "rank 1 passed a weight that is negative, NaN, infinite or above 2**53", "got 1e+36"),
        ({"weight": torch.tensor(1e36)}, "rank 1 passed a weight that is negative, NaN, infinite or above 2**53", None),
        ({"weight": "three"}, "rank 1 passed a weight that is not a real number", "got str 'three'"),
        ({"weight": torch.ones(2)}, "rank 1 passed a weight that is not a real number", "shape (2,)"),
        ({"loss": torch.ones(3)}, "rank 1 passed a loss that is not a scalar", "shape (3,)"),
        ({"loss": torch.tensor(0.5)}, "rank 1 passed a loss that is not a scalar", "does not require a gradient"),
        ({"metrics": {"typo": 1.0}}, "rank 1 passed a metric that is not a number or not declared", "['typo']"),
        ({"metrics": {"ok": "x"}}, "rank 1 passed a metric that is not a number", "metric 'ok' must be a real"),
    ],
    ids=["negative", "nan", "inf", "negative-tensor", "huge", "huge-tensor", "string", "vector", "vector-loss",
         "constant-loss", "metric-name", "metric-value"],
)
def test_bad_input_raises_on_every_rank(bad, shared, own):
    results = run_ranks(bad_step_then_good_step, 3, bad, timeout=60)
    for rank, (message, next_weight) in enumerate(results):
        assert shared in message, f"rank {rank}: {message}"
        if own and rank == 1:
            assert own in message, message
        assert "not applied" in message and "gradients are dropped (set to None)" in message
        assert next_weight == 12, "the next good step must work on every rank"


def bad_weight_inside_no_sync(rank: int, world_size: int) -> str:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    _, _, slices = global_batch(0, [4] * world_size)
    x, y = slices[rank]
    with model.no_sync():
        model.backward(mse(model(x), y), weight=-5 if rank == 0 else 4)
    model.backward(mse(model(x), y), weight=4)


def test_bad_weight_in_a_micro_step_is_raised_at_the_synced_step_everywhere():
    for text in run_ranks_expecting_errors(bad_weight_inside_no_sync, 2):
        assert "rank 0 passed a weight that is negative" in text


def wrap(rank: int, world_size: int, variant: str) -> None:
    import hsync

    net = make_net(seed=0)
    if rank == 1 and variant == "shape":
        net = make_net(seed=0, width=7)
    elif rank == 1 and variant == "dtype":
        net = make_net(seed=0, dtype=torch.float32)
    elif rank == 1 and variant == "layout":  # as channels_last chosen on some ranks only
        net.inp.weight.data = net.inp.weight.data.t().contiguous().t()
    elif rank == 1 and variant == "count":
        net.extra = nn.Linear(2, 2, dtype=torch.float64)
    elif variant == "sparse":
        net.embed = nn.Embedding(10, 3, sparse=True)
    elif variant == "sparse itself":
        net = nn.Embedding(10, 3, sparse=True)
    elif variant == "meta":  # a model built on the meta device, to be materialised after the wrap
        net = net.to("meta")
    elif variant == "lazy":
        net.lazy = nn.LazyLinear(2)
    elif rank == 1 and variant == "devices":
        net.out.to("meta")
    elif variant == "in torch DDP":
        net = nn.parallel.DistributedDataParallel(net)  # collective: on every rank
    elif rank == 1 and variant == "in DataParallel":
        net = nn.DataParallel(net)
    settings = {
        "comm_dtype differs": dict(comm_dtype=torch.bfloat16 if rank == 1 else None),
        "bucket cap differs": dict(bucket_cap_mb=25 + rank),
        # In another order, each rank's sums went under the others' names.
        "metric names in another order": dict(metric_names=("correct", "count")[::1 - 2 * rank]),
        "metric names differ": dict(metric_names=("correct", "count")[:2 - rank]),
        "comm_dtype int": dict(comm_dtype=torch.int64),
        "comm_dtype str": dict(comm_dtype="bf16"),
        "bucket cap str": dict(bucket_cap_mb="25"),  # torch's DDP multiplies the string by 2**20
        "bucket cap inf": dict(bucket_cap_mb=float("inf")),
        "first bucket cap 0": dict(first_bucket_cap_mb=0),
        "metric names str": dict(metric_names="correct"),  # would be seven one-letter names
        "metric names twice": dict(metric_names=("correct", "correct")),
    }
    hsync.WeightedDDP(net, **settings.get(variant, {}))


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("shape", "rank 0 has parameter 'inp.weight' of shape [6, 4], torch.float64, rank 1 has parameter "
                  "'inp.weight' of shape [7, 4]"),
        ("dtype", "rank 0 has parameter 'inp.weight' of shape [6, 4], torch.float64, rank 1 has parameter "
                  "'inp.weight' of shape [6, 4], torch.float32"),
        # Was taken: the sums added the elements of one layout to those of the other, silently.
        ("layout", "parameter 'inp.weight' is laid out with strides (4, 1) on rank 0 and (1, 6) on rank 1"),
        ("count", "rank 0 has 10 parameters and buffers, rank 1 has 12 (first extra on rank 1: parameter "
                  "'extra.weight'"),
        ("sparse", "on rank 0, 'embed' produces sparse gradients"),
        ("sparse itself", "on rank 0, 'Embedding' produces sparse gradients"),  # was named ''
        # Was taken, and the first backward raised "Tensor.item() cannot be called on meta tensors".
        ("meta", "on rank 0, 'inp.weight' is on the meta device (no values yet): materialise the model before "
                 "wrapping"),
        # Was torch's "Can't access the shape of an uninitialized parameter", which names no parameter.
        ("lazy", "on rank 0, 'lazy.weight' is not initialized yet (a lazy module): run a dummy forward pass"),
        ("devices", "on rank 1, parameters on several devices (cpu, meta)"),
        ("in torch DDP", "hsync: cannot wrap the model: on rank 0, it is already wrapped in a "
                         "DistributedDataParallel, whose own collectives would run beside hsync's; pass the module "
                         "inside it (its .module)"),
        ("in DataParallel", "on rank 1, it is already wrapped in a torch DataParallel"),  # said on every rank
        ("comm_dtype differs", "comm_dtype differs across ranks: None on rank 0, torch.bfloat16 on rank 1"),
        ("bucket cap differs", "bucket_cap_mb differs across ranks: 25.0 on rank 0, 26.0 on rank 1"),
        ("metric names in another order",
         "metric_names differs across ranks: ('correct', 'count') on rank 0, ('count', 'correct') on rank 1"),
        ("metric names differ", "metric_names differs across ranks: ('correct', 'count') on rank 0, ('correct',) on "
                                "rank 1"),
        ("comm_dtype int", "ValueError: hsync.WeightedDDP: comm_dtype must be None or one of torch.float32, "
                           "torch.float64, torch.float16, torch.bfloat16, got dtype torch.int64"),
        ("comm_dtype str", "TypeError: hsync.WeightedDDP: comm_dtype must be None or one of torch.float32, "
                           "torch.float64, torch.float16, torch.bfloat16, got str 'bf16'"),
        ("bucket cap str", "TypeError: hsync.WeightedDDP: bucket_cap_mb must be a number of MiB, got str '25'"),
        ("bucket cap inf", "ValueError: hsync.WeightedDDP: bucket_cap_mb must be a positive and finite number of MiB, "
                           "got inf"),
        ("first bucket cap 0", "ValueError: hsync.WeightedDDP: first_bucket_cap_mb must be a positive and finite "
                               "number of MiB, got 0"),
        ("metric names str", "TypeError: hsync.WeightedDDP: metric_names must be a list or tuple of names, got str "
                             "'correct'"),
        ("metric names twice", "ValueError: hsync.WeightedDDP: metric_names must be distinct and not empty, got "
                               "('correct', 'correct')"),
    ],
)
def test_models_that_cannot_be_wrapped_fail_on_every_rank(variant, expected):
    for text in run_ranks_expecting_errors(wrap, 2, variant):
        assert expected in text, text


def failing_backward(rank: int, world_size: int, failing_ranks: set[int], accumulating: bool):
    """A backward that raises on some ranks, in a synchronised step or in a no_sync micro-step of one:
    the step still completes everywhere, and reads as not finite (its gradient is partial)."""
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    _, _, slices = global_batch(0, [4] * world_size)
    x, y = slices[rank]

    def fail(grad):
        raise RuntimeError("simulated failure inside backward")

    # The first layer's gradient comes last: the failure is midway, with the others computed.
    hook = model.module.inp.weight.register_hook(fail) if rank in failing_ranks else None
    error, stats = None, None
    with model.no_sync() if accumulating else contextlib.nullcontext():
        try:
            stats = model.backward(mse(model(x), y), weight=4)
        except RuntimeError as e:
            error = str(e)
    if hook:
        hook.remove()
    if accumulating:
        stats = model.backward(mse(model(x), y), weight=4)
    model.module.zero_grad()
    return error, stats and stats.finite, model.backward(mse(model(x), y), weight=4).finite


@pytest.mark.parametrize("accumulating", [False, True], ids=["synced", "no-sync"])
@pytest.mark.parametrize("failing_ranks", [{0, 1}, {1}], ids=["all-ranks", "one-rank"])
def test_a_failed_weighted_backward_completes_the_step_skipped_on_every_rank(failing_ranks, accumulating):
    for rank, (error, finite, next_finite) in enumerate(run_ranks(failing_backward, 2, failing_ranks, accumulating)):
        assert ("simulated failure" in error) if rank in failing_ranks else error is None
        if accumulating or rank not in failing_ranks:
            assert finite is False, "a partial gradient is not stepped on: the step reads as not finite"
        assert next_finite, "the next step runs on every rank"


def interrupted_plain_backward(rank: int, world_size: int) -> None:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    _, _, slices = global_batch(0, [4] * world_size)
    x, y = slices[rank]

    def fail(grad):
        raise RuntimeError("simulated failure inside backward")

    hook = model.module.inp.weight.register_hook(fail)
    try:
        mse(model(x), y).backward()
    except RuntimeError as error:
        assert "simulated failure" in str(error)
    hook.remove()
    mse(model(x), y).backward()


def test_a_plain_backward_after_an_interrupted_one_is_refused():
    for text in run_ranks_expecting_errors(interrupted_plain_backward, 2):
        assert "a new backward started before the previous gradient reduction finished" in text
        assert "model._remove_autograd_hooks()" in text, text  # and says how to go on


def evaluation_on_rank_0_alone(rank: int, world_size: int) -> str | None:
    """A training step, then an evaluation (eval(), no_grad) through the wrapper on rank 0 alone, as DDP users
    write it: its forward takes rank 0's buffers (BatchNorm's statistics) from a broadcast rank 1 never joins."""
    import hsync

    model = hsync.WeightedDDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), timeout=datetime.timedelta(seconds=2))
    model(torch.randn(4, 4)).sum().backward()
    if rank != 0:
        time.sleep(4)  # in no collective of hsync's, as at a barrier of torch's
        return None
    model.eval()
    with torch.no_grad():
        try:
            model(torch.randn(4, 4))
        except RuntimeError as error:
            return str(error)
    return "no error"


def test_an_evaluation_through_the_wrapper_on_one_rank_says_to_run_the_module_instead():
    # DDP hangs there (its timeout, 30 minutes by default); hsync ends at its deadline and says what to do.
    error = run_ranks(evaluation_on_rank_0_alone, 2, timeout=60)[0]
    assert re.search(r"broadcast #\d+ of the buffers before a forward without gradients .* to evaluate on some "
                     r"ranks only, run model.module there\) from rank 0 .* did not complete within the 2.00 s "
                     r"deadline", error), error


def wrapped_over_a_group_of(rank: int, world_size: int, backends: str | None) -> str:
    """A group made as Accelerate makes one under torchrun ('undefined': torch picks each device's backend), whose
    backends are `backends` where given (a group without gloo, which this machine cannot make)."""
    import torch.distributed as dist

    import hsync

    dist.destroy_process_group()
    dist.init_process_group("undefined", store=dist.HashStore(), rank=0, world_size=1)
    if backends is not None:
        dist.get_backend_config = lambda group=None: backends
    try:
        model = hsync.WeightedDDP(nn.Linear(2, 2))
        return f"trained, weight {model.backward(model(torch.ones(1, 2)).sum(), weight=1).weight}"
    except RuntimeError as error:
        return str(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_a_group_without_gloo_on_a_machine_without_a_gpu_is_refused_naming_its_backends():
    # get_backend() says 'undefined' for both; their configurations tell them apart.
    assert run_ranks(wrapped_over_a_group_of, 1, None) == ["trained, weight 1.0"]
    assert run_ranks(wrapped_over_a_group_of, 1, "cuda:nccl") == [
        "hsync: the process group's backend is 'cuda:nccl', and on a machine without a GPU hsync needs gloo: "
        "init_process_group('gloo') (Accelerate: Accelerator(cpu=True), or accelerate launch --cpu)"]
