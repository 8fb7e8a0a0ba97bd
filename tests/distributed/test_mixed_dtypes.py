"""A model with float32 and 16-bit parameters: one set of buckets per dtype, each reduced exactly.

With float16 parameters the engine scales before the sum even on the CPU (Note [Deferred
normalisation] in csrc/engine.h), so both of its ways of normalising are checked here."""

import pytest
import torch
from torch import nn

from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]

SIZES = [3, 8]


class Mixed(nn.Module):
    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = nn.Linear(8, 16, dtype=low)
        self.high = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(torch.relu(self.low(x.to(self.low.weight.dtype))).float()).squeeze(-1)


def mixed_step(rank: int, world_size: int, low: torch.dtype, comm_dtype: torch.dtype | None = None):
    import copy

    import torch.distributed as dist

    import hsync

    torch.manual_seed(0)
    net = Mixed(low)
    plain = copy.deepcopy(net)
    model = hsync.WeightedDDP(net, bucket_cap_mb=1e-4 if comm_dtype is None else 1.0, first_bucket_cap_mb=1e-4,
                              comm_dtype=comm_dtype)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(SIZES[rank], 8, generator=g), torch.randn(SIZES[rank], generator=g)

    loss_fn = nn.MSELoss()
    loss_fn(plain(x), y).backward()
    local = {name: p.grad.double() for name, p in plain.named_parameters()}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, local)
    expected = {name: sum(SIZES[r] * everyone[r][name] for r in range(world_size)) / sum(SIZES) for name in local}

    model.backward(loss_fn(model(x), y), weight=SIZES[rank])
    got = {name: p.grad for name, p in net.named_parameters()}
    dtypes = [p.dtype for p in net.parameters()]
    bucket_dtypes = [{dtypes[i] for i in bucket} for bucket in model.bucket_params]
    return expected, got, bucket_dtypes


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_float32_and_16_bit_parameters_are_reduced_in_their_own_buckets(low):
    for expected, got, bucket_dtypes in run_ranks(mixed_step, 2, low):
        assert all(len(d) == 1 for d in bucket_dtypes), bucket_dtypes
        assert {next(iter(d)) for d in bucket_dtypes} == {torch.float32, low}
        for name, value in expected.items():
            assert got[name].dtype == (low if name.startswith("low") else torch.float32)
            # bf16 keeps 8 bits of mantissa, fp16 11: each scaled term and the sum round once or twice.
            tol = dict(rtol=2e-2, atol=1e-3) if name.startswith("low") else dict(rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got[name].double(), value, **tol, msg=name)


def test_one_comm_dtype_puts_every_dtype_in_the_same_buckets():
    # float32 and float16 gradients both travel as bfloat16 and come back in their own dtypes.
    for expected, got, bucket_dtypes in run_ranks(mixed_step, 2, torch.float16, torch.bfloat16):
        assert {torch.float32, torch.float16} in bucket_dtypes, bucket_dtypes
        for name, value in expected.items():
            assert got[name].dtype == (torch.float16 if name.startswith("low") else torch.float32)
            torch.testing.assert_close(got[name].double(), value, rtol=2e-2, atol=1e-3, msg=name)


def large_float16_gradients(rank: int, world_size: int) -> list[tuple[bool, torch.Tensor]]:
    import hsync

    net = nn.Module()
    net.contiguous = nn.Parameter(torch.ones(4, 3, dtype=torch.float16))
    net.transposed = nn.Parameter(torch.ones(3, 4, dtype=torch.float16).t())
    # Buckets of float32: on the CPU the sum is normalised at the write-back, and the sum of the
    # weighted terms (3 x 10000 + 8 x 20000 = 190000) does not fit float16, only the mean does.
    model = hsync.WeightedDDP(net, comm_dtype=torch.float32)
    per_example = 10000.0 * (rank + 1)
    loss = sum((p.float() * per_example).sum() for p in (net.contiguous, net.transposed))
    model.backward(loss, weight=SIZES[rank])
    return [(p.grad.is_contiguous(), p.grad) for p in (net.contiguous, net.transposed)]


def test_float16_gradients_normalised_at_the_write_back_are_scaled_before_the_cast():
    mean = sum(SIZES[r] * 10000.0 * (r + 1) for r in range(2)) / sum(SIZES)
    for per_param in run_ranks(large_float16_gradients, 2):
        assert [contiguous for contiguous, _ in per_param] == [True, False]  # both ways of writing back
        for _, grad in per_param:
            assert grad.dtype == torch.float16
            torch.testing.assert_close(grad.double(), torch.full(grad.shape, mean, dtype=torch.float64), rtol=1e-3,
                                       atol=0)
