"""Buffers of any dtype travel from rank 0 as their bytes: at wrap time and before each forward."""

import pytest
import torch
from torch import nn

from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]

# NCCL has a type for none of the first six; a broadcast carries bytes, whatever they mean.
BUFFER_DTYPES = (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.complex64,
                 torch.float8_e5m2, torch.bool, torch.int8, torch.float64)


class Buffered(nn.Module):
    """A layer and buffers of every dtype, each rank's made of other random bytes."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        g = torch.Generator().manual_seed(rank)
        for i, dtype in enumerate(BUFFER_DTYPES):
            raw = torch.randint(0, 256, (3, 8 * (i + 1)), dtype=torch.uint8, generator=g)
            self.register_buffer(f"b{i}", raw.view(dtype) if dtype != torch.bool else raw > 127)
        self.register_buffer("transposed", torch.randn(4, 6, generator=g).t())  # not contiguous
        self.register_buffer("scalar", torch.randint(0, 1000, (), generator=g, dtype=torch.int16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def as_bytes(module: nn.Module) -> dict[str, bytes]:
    return {name: b.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
            for name, b in module.named_buffers()}


def buffers_of_every_dtype(rank: int, world_size: int, device: str = "cpu"):
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    module = Buffered(rank).to(device)
    own = as_bytes(module)
    model = hsync.WeightedDDP(module)
    wrapped = as_bytes(model.module)
    for name, b in model.module.named_buffers():  # each rank changes its own: rank 0's come back
        b.copy_(Buffered(rank + 10).to(device).get_buffer(name))
    before_forward = as_bytes(model.module)
    model(torch.ones(1, 2, device=device)).sum().backward()
    return own, wrapped, before_forward, as_bytes(model.module), model.module.transposed.is_contiguous()


def check_rank_zeros_bytes_everywhere(results) -> None:
    own_0, _, changed_0, _, _ = results[0]
    for rank, (own, wrapped, _, after_forward, contiguous) in enumerate(results):
        assert wrapped == own_0, f"rank {rank} did not receive rank 0's buffers at wrap time"
        assert after_forward == changed_0, f"rank {rank} did not receive rank 0's buffers in its forward"
        assert not contiguous, "a buffer's layout stays the module's"
        if rank > 0:
            assert own != own_0, "the ranks' own buffers differ, or the test shows nothing"


def test_buffers_of_every_dtype_are_broadcast_as_bytes():
    check_rank_zeros_bytes_everywhere(run_ranks(buffers_of_every_dtype, 2))
