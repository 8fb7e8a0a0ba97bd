"""The CUDA scale-and-pack kernel against torch's own ops (skipped without a GPU)."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def pack(grad: torch.Tensor, scale: float, offset: int = 0):
    from hsync import _C

    buffer = torch.full((grad.numel() + offset + 2,), 7.0, dtype=grad.dtype, device="cuda")
    out = buffer[offset:offset + grad.numel()]
    flags = buffer[-2:].zero_()
    _C.scale_and_pack(grad, out, torch.tensor(scale, dtype=torch.float64, device="cuda"), flags[0:1], flags[1:2])
    return out, flags


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 4096, 1_000_003])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_scaled_copy_matches_torch(dtype, numel, offset):
    grad = torch.randn(numel, dtype=torch.float64, device="cuda").to(dtype)
    out, flags = pack(grad, 0.37, offset)
    expected = (grad.to(torch.float64 if dtype == torch.float64 else torch.float32) * 0.37).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert flags.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_values_raise_the_flag_even_with_scale_zero(dtype, bad):
    grad = torch.ones(1_000_000, dtype=dtype, device="cuda")
    grad[654_321] = bad
    _, flags = pack(grad, 0.0)
    assert flags[0].item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_a_gradient_that_is_its_slot_is_scaled_in_place(dtype, offset):
    from hsync import _C

    # gradient_as_bucket_view: the gradient is the slot itself.
    buffer = torch.randn(1_000_003 + offset + 2, dtype=torch.float64, device="cuda").to(dtype)
    slot, flags = buffer[offset:offset + 1_000_003], buffer[-2:].zero_()
    expected = (slot.to(torch.float64 if dtype == torch.float64 else torch.float32) * 0.37).to(dtype)
    _C.scale_and_pack(slot, slot, torch.tensor(0.37, dtype=torch.float64, device="cuda"), flags[0:1], flags[1:2])
    torch.testing.assert_close(slot, expected, rtol=0, atol=0)
    assert flags.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_packing_into_another_dtype_rounds_once(in_dtype, out_dtype, offset):
    from hsync import _C

    grad = torch.randn(1_000_003, dtype=torch.float64, device="cuda").to(in_dtype)
    buffer = torch.full((grad.numel() + offset + 2,), 7.0, dtype=out_dtype, device="cuda")
    out, flags = buffer[offset:offset + grad.numel()], buffer[-2:].zero_()
    _C.scale_and_pack(grad, out, torch.tensor(0.37, dtype=torch.float64, device="cuda"), flags[0:1], flags[1:2])
    op = torch.float64 if torch.float64 in (in_dtype, out_dtype) else torch.float32
    torch.testing.assert_close(out, (grad.to(op) * 0.37).to(out_dtype), rtol=0, atol=0)
    assert flags.tolist() == [0.0, 1.0]


def test_a_float32_value_that_overflows_float16_raises_the_flag():
    from hsync import _C

    grad = torch.ones(1_000_000, device="cuda")
    grad[999_999] = 40_000.0  # finite, but 80,000 after scaling: float16 ends at 65,504
    out = torch.empty(1_000_000, dtype=torch.float16, device="cuda")
    flags = torch.zeros(2, dtype=torch.float16, device="cuda")
    _C.scale_and_pack(grad, out, torch.tensor(2.0, dtype=torch.float64, device="cuda"), flags[0:1], flags[1:2])
    assert flags.tolist() == [1.0, 1.0]
