"""Gradients that travel in bfloat16 or float16 (WeightedDDP(comm_dtype=...)): within that dtype's
rounding of the float32 result, in weighted and plain steps, no_sync windows and with bucket views;
non-finite values (and float16 overflow) still reported on every rank; torch DDP with its own
compression hook as a second reference."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.distributed.workloads import global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

LOW = [torch.bfloat16, torch.float16]
SIZES = [[[5, 2, 3]], [[1, 4, 0], [3, 0, 6]]]  # steps[s][micro][rank]: one step, then a 2-micro-step window


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _subnormal_spacing(dtype: torch.dtype) -> float:
    """The absolute rounding error of values too small for the dtype's normal range (float16's start at 6e-5)."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def weighted_steps(rank: int, world_size: int, low: torch.dtype, views: bool, device: str = "cpu") -> list[dict]:
    import hsync

    f32 = torch.float32
    exact = hsync.WeightedDDP(make_net(seed=0, dtype=f32).to(device))
    cast = hsync.WeightedDDP(make_net(seed=0, dtype=f32).to(device), comm_dtype=low, gradient_as_bucket_view=views)
    plain = make_net(seed=0, dtype=f32)
    results = []
    for step, micro_steps in enumerate(SIZES):
        terms = []  # this rank's weighted local gradients, for the rounding bound
        for model in (exact, cast):
            model.zero_grad(set_to_none=False)
        for micro, sizes in enumerate(micro_steps):
            x, y = global_batch(step, sizes, micro, dtype=f32)[2][rank]
            last = micro == len(micro_steps) - 1
            for model in (exact, cast):
                with contextlib.nullcontext() if last else model.no_sync():
                    out = model(x.to(device))
                    model.backward(mse(out, y.to(device)) if sizes[rank] else out.sum() * 0, weight=sizes[rank])
            if sizes[rank]:
                plain.zero_grad()
                mse(plain(x), y).backward()
                terms.append({n: sizes[rank] * p.grad.double() for n, p in plain.named_parameters()
                              if p.grad is not None})
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, terms)
        total = sum(sum(sizes) for sizes in micro_steps)
        bound = {n: sum(t[n].abs() for mine in everyone for t in mine if n in t) / total
                 for n, _ in plain.named_parameters()}
        results.append({
            "exact": {n: p.grad.cpu() for n, p in exact.module.named_parameters() if p.grad is not None},
            "cast": {n: p.grad.cpu() for n, p in cast.module.named_parameters() if p.grad is not None},
            "bound": bound,
        })
    return results


@pytest.mark.parametrize("views", [False, True], ids=["copied", "views"])
@pytest.mark.parametrize("low", LOW, ids=str)
def test_weighted_gradients_are_within_the_rounding_of_the_comm_dtype(low, views):
    check_within_rounding(run_ranks(weighted_steps, 3, low, views), low)


def check_within_rounding(per_rank: list[list[dict]], low: torch.dtype) -> None:
    """Every rank's gradients of weighted_steps, sent in `low`, against those sent in float32."""
    u = _unit_roundoff(low)
    for rank, results in enumerate(per_rank):
        for step, result in enumerate(results):
            assert result["cast"].keys() == result["exact"].keys()
            largest_error = 0.0
            for name, exact in result["exact"].items():
                got = result["cast"][name]
                assert got.dtype == torch.float32, (name, got.dtype)
                # Each rank's term is rounded once into the bucket, and each of the two additions once.
                error = (got.double() - exact.double()).abs()
                allowed = 3 * u * result["bound"][name] + 1e-6 * exact.double().abs() + 3 * _subnormal_spacing(low)
                assert (error <= allowed).all(), (rank, step, name, (error - allowed).max().item())
                largest_error = max(largest_error, error.max().item())
            assert largest_error > 0, "the gradients did not travel in the narrower dtype"


def plain_mean(rank: int, world_size: int, low: torch.dtype) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hsync

    f32 = torch.float32
    x, y = global_batch(0, [4] * world_size, dtype=f32)[2][rank]
    hook = default_hooks.bf16_compress_hook if low == torch.bfloat16 else default_hooks.fp16_compress_hook
    models = {"exact": hsync.WeightedDDP(make_net(seed=0, dtype=f32)),
              "hsync": hsync.WeightedDDP(make_net(seed=0, dtype=f32), comm_dtype=low),
              "ddp": DDP(make_net(seed=0, dtype=f32), find_unused_parameters=True)}  # Net has unused ones
    models["ddp"].register_comm_hook(None, hook)
    wrapper = default_hooks.bf16_compress_wrapper if low == torch.bfloat16 else default_hooks.fp16_compress_wrapper
    # DDP's ways of asking for it: the hook, or the wrapper around the mean's all-reduce; and that
    # all-reduce alone, in full precision. The hook decides, whatever comm_dtype the wrapper was given.
    for name, ddp_hook in (("hsync_hook", hook), ("hsync_wrapper", wrapper(default_hooks.allreduce_hook)),
                           ("hsync_allreduce_hook", default_hooks.allreduce_hook)):
        models[name] = hsync.WeightedDDP(make_net(seed=0, dtype=f32), comm_dtype=low if "allreduce" in name else None)
        models[name].register_comm_hook(None, ddp_hook)
    # And DDP's built-in (C++) hooks: the same two, by name.
    builtin = {"hsync_builtin_allreduce": dist.BuiltinCommHookType.ALLREDUCE}
    if low == torch.float16:
        builtin["hsync_builtin_fp16"] = dist.BuiltinCommHookType.FP16_COMPRESS
    for name, hook_type in builtin.items():
        models[name] = hsync.WeightedDDP(make_net(seed=0, dtype=f32), comm_dtype=low if "allreduce" in name else None)
        models[name]._register_builtin_comm_hook(hook_type)
    grads = {}
    for name, model in models.items():
        mse(model(x), y).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}
    return grads


@pytest.mark.parametrize("low", LOW, ids=str)
def test_a_plain_backward_averages_as_ddp_with_its_compression_hook_does(low):
    for grads in run_ranks(plain_mean, 2, low):
        assert grads["hsync"].keys() == grads["exact"].keys() == grads["ddp"].keys()
        for name, exact in grads["exact"].items():
            scale = exact.abs().max().item()
            for who in ("hsync", "ddp"):
                torch.testing.assert_close(grads[who][name], exact, rtol=4 * _unit_roundoff(low),
                                           atol=4 * _unit_roundoff(low) * scale, msg=f"{who} {name}")
            if low == torch.bfloat16:  # DDP rounds, then halves: exact in bfloat16's range, so one rounding too
                assert torch.equal(grads["hsync"][name], grads["ddp"][name]), name
            assert torch.equal(grads["hsync_hook"][name], grads["hsync"][name]), name
            assert torch.equal(grads["hsync_wrapper"][name], grads["hsync"][name]), name
            assert torch.equal(grads["hsync_allreduce_hook"][name], exact), name
            assert torch.equal(grads["hsync_builtin_allreduce"][name], exact), name
            if low == torch.float16:
                assert torch.equal(grads["hsync_builtin_fp16"][name], grads["hsync"][name]), name


def nonfinite_steps(rank: int, world_size: int, low: torch.dtype) -> list[bool]:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0, dtype=torch.float32), comm_dtype=low)
    x, y = global_batch(0, [4] * world_size, dtype=torch.float32)[2][rank]
    poisoned = {"on": False}
    model.module.out.weight.register_hook(lambda g: g * float("nan") if poisoned["on"] else g)
    finite = []
    for case in ("nan on a rank of weight 0", "large", "fine"):
        model.zero_grad()
        loss = mse(model(x), y)
        poisoned["on"] = case.startswith("nan") and rank == 1
        if case == "large":
            loss = loss * 1e8  # beyond float16's 65504 once packed, well inside bfloat16's range
        finite.append(model.backward(loss, weight=0 if poisoned["on"] else 4).finite)
    return finite


@pytest.mark.parametrize("low", LOW, ids=str)
def test_non_finite_gradients_and_float16_overflow_are_seen_on_every_rank(low):
    for finite in run_ranks(nonfinite_steps, 2, low):
        assert finite == [False, low == torch.bfloat16, True]


def hook_too_late_or_twice(rank: int, world_size: int) -> list[str]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    import hsync

    errors = []
    twice = hsync.WeightedDDP(make_net(seed=0))
    twice.register_comm_hook(None, default_hooks.fp16_compress_hook)
    late = hsync.WeightedDDP(make_net(seed=0))
    x, y = global_batch(0, [4] * world_size)[2][rank]
    mse(late(x), y).backward()
    for model, hook in ((twice, default_hooks.bf16_compress_hook), (late, default_hooks.bf16_compress_hook),
                        (late, powerSGD_hook)):
        try:
            model.register_comm_hook(None, hook)
        except (RuntimeError, ValueError) as error:
            errors.append(str(error))
    try:
        hsync.WeightedDDP(make_net(seed=0))._register_builtin_comm_hook("ALLREDUCE")
    except TypeError as error:
        errors.append(str(error))
    return errors


def test_register_comm_hook_refuses_a_second_call_a_late_call_and_a_name():
    for errors in run_ranks(hook_too_late_or_twice, 2):
        assert len(errors) == 4, errors
        assert "can only be called once" in errors[0]
        assert "before the first backward" in errors[1]
        assert "before the first backward" in errors[2]  # a hook of the user's (PowerSGD) alike
        assert "register_comm_hook takes hook(state, bucket), got str 'ALLREDUCE'" in errors[3]  # a name, not the enum


def sum_beyond_float16(rank: int, world_size: int, low: torch.dtype) -> tuple[bool, float]:
    import hsync

    layer = torch.nn.Linear(1, 1, bias=False)
    model = hsync.WeightedDDP(layer, comm_dtype=low)
    # The gradient is 100000 on every rank: each rank's half, 50000, fits float16; their sum does not.
    stats = model.backward((model(torch.ones(1, 1)) * 1e5).sum(), weight=1)
    return stats.finite, float(layer.weight.grad)


@pytest.mark.parametrize("low", LOW, ids=str)
def test_a_float16_sum_that_overflows_is_seen_on_every_rank(low):
    for finite, grad in run_ranks(sum_beyond_float16, 2, low):
        if low == torch.float16:
            assert (finite, grad) == (False, float("inf"))
        else:
            assert finite
            assert grad == pytest.approx(1e5, rel=2**-8)


def hook_refused_on_one_rank(rank: int, world_size: int) -> tuple[str, str, str | None]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    try:  # rank 1 a hook of its own, rank 0 one hsync's pack does itself
        model.register_comm_hook(None, powerSGD_hook if rank == 1 else default_hooks.bf16_compress_hook)
        error = "none"
    except RuntimeError as refused:
        error = str(refused)
    after_refusal = str(model.comm_dtype)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # the refused call left nothing behind
    return error, after_refusal, str(model.comm_dtype)


def test_a_hook_refused_on_one_rank_is_raised_on_every_rank():
    errors, after_refusal, after = zip(*run_ranks(hook_refused_on_one_rank, 2, timeout=30), strict=True)
    for error in errors:
        assert "comm_dtype differs across ranks: torch.bfloat16 on rank 0, None on rank 1" in error, errors
    assert after_refusal == ("None", "None")
    assert after == ("torch.float16", "torch.float16")
