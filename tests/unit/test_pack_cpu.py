"""The CPU scale-and-pack kernel against torch's own ops."""

import math

import pytest
import torch

from hsync import _C

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def pack(grad: torch.Tensor, scale: float):
    out = torch.full((grad.numel(),), 7.0, dtype=grad.dtype)
    flags = torch.zeros(2, dtype=grad.dtype)
    _C.scale_and_pack(grad, out, torch.tensor(scale, dtype=torch.float64), flags[0:1], flags[1:2])
    return out, flags


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 31, 1000, 200_003])
def test_scaled_copy_matches_torch(dtype, numel):
    grad = torch.randn(numel, dtype=torch.float64).to(dtype)
    out, flags = pack(grad, 0.37)
    # torch computes half-precision products in float32 and rounds once, as the kernel does.
    expected = (grad.to(torch.float64 if dtype == torch.float64 else torch.float32) * 0.37).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert flags.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_raise_the_flag_even_with_scale_zero(dtype, bad):
    grad = torch.ones(100_000, dtype=dtype)
    grad[77_777] = bad
    _, flags = pack(grad, 0.0)
    assert flags[0].item() == 1.0


def test_non_contiguous_gradients_are_packed_in_logical_order():
    grad = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    out, _ = pack(grad, 2.0)
    assert out.tolist() == (grad.contiguous().flatten() * 2).tolist()


def test_a_slot_of_the_wrong_size_is_refused():
    with pytest.raises(RuntimeError, match="does not fit its slot"):
        _C.scale_and_pack(torch.ones(4), torch.ones(5), torch.tensor(1.0, dtype=torch.float64),
                          torch.zeros(1), torch.zeros(1))


def test_a_slot_with_gaps_is_refused_rather_than_written_past():
    slot = torch.zeros(4, 2)[:, 0]  # 4 elements, every other one of 8
    with pytest.raises(RuntimeError, match="slot must be dense"):
        _C.scale_and_pack(torch.ones(4), slot, torch.tensor(1.0, dtype=torch.float64), torch.zeros(1), torch.zeros(1))


@pytest.mark.parametrize("grad_layout", ["the slot's", "contiguous"])
def test_a_dense_slot_laid_out_as_its_parameter_takes_the_gradient_element_by_element(grad_layout):
    # A channels_last parameter's slot (Engine::allocate lays it out so, as DDP's bucket views are).
    memory = torch.full((2 * 3 * 2 * 2 + 1,), 7.0)
    slot = memory[:-1].as_strided((2, 3, 2, 2), (12, 1, 6, 3))
    grad = torch.randn(2, 3, 2, 2)
    grad = grad.to(memory_format=torch.channels_last) if grad_layout == "the slot's" else grad.contiguous()
    flags = torch.zeros(2)
    _C.scale_and_pack(grad, slot, torch.tensor(2.0, dtype=torch.float64), flags[0:1], flags[1:2])
    torch.testing.assert_close(slot, grad * 2, rtol=0, atol=0)
    assert memory[-1].item() == 7.0 and flags.tolist() == [0.0, 1.0], "nothing written past the slot"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_gradient_that_is_its_slot_is_scaled_in_place(dtype):
    # gradient_as_bucket_view: the gradient is the slot itself.
    slot = torch.randn(200_003, dtype=torch.float64).to(dtype)
    expected = (slot.to(torch.float64 if dtype == torch.float64 else torch.float32) * 0.37).to(dtype)
    slot[1000] = math.nan
    expected[1000] = math.nan
    flags = torch.zeros(2, dtype=dtype)
    _C.scale_and_pack(slot, slot, torch.tensor(0.37, dtype=torch.float64), flags[0:1], flags[1:2])
    torch.testing.assert_close(slot, expected, rtol=0, atol=0, equal_nan=True)
    assert flags.tolist() == [1.0, 1.0]


def _op_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The kernel's arithmetic for a pair of dtypes: float64 if either side is, else float32."""
    return torch.float64 if torch.float64 in (a, b) else torch.float32


# Small and large: a large one is cast through torch's vectorised conversion (Note [Staged cast]).
@pytest.mark.parametrize("numel", [1000, 200_003])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_dtype", DTYPES, ids=str)
def test_packing_into_another_dtype_rounds_once(in_dtype, out_dtype, numel):
    grad = torch.randn(numel, dtype=torch.float64).to(in_dtype)
    out = torch.full((grad.numel(),), 7.0, dtype=out_dtype)
    flags = torch.zeros(2, dtype=out_dtype)
    _C.scale_and_pack(grad, out, torch.tensor(0.37, dtype=torch.float64), flags[0:1], flags[1:2])
    op = _op_dtype(in_dtype, out_dtype)
    torch.testing.assert_close(out, (grad.to(op) * 0.37).to(out_dtype), rtol=0, atol=0)
    assert flags.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_value_is_seen_across_a_cast(bad):
    grad = torch.ones(100_000)
    grad[4321] = bad
    out, flags = torch.empty(100_000, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)
    _C.scale_and_pack(grad, out, torch.tensor(0.0, dtype=torch.float64), flags[0:1], flags[1:2])
    assert flags.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("numel", [1000, 100_000])
def test_a_float32_value_that_overflows_float16_raises_the_flag(numel):
    grad = torch.ones(numel)
    grad[-1] = 40_000.0  # finite, but 80,000 after scaling: float16 ends at 65,504
    out, flags = torch.empty(numel, dtype=torch.float16), torch.zeros(2, dtype=torch.float16)
    _C.scale_and_pack(grad, out, torch.tensor(2.0, dtype=torch.float64), flags[0:1], flags[1:2])
    assert flags.tolist() == [1.0, 1.0] and math.isinf(out[-1].item())
    _C.scale_and_pack(grad, out, torch.tensor(1.0, dtype=torch.float64), flags[0:1].zero_(), flags[1:2])
    assert flags.tolist() == [0.0, 1.0] and out[-1].item() == 40_000.0
