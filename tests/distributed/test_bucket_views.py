"""gradient_as_bucket_view: every gradient lives in its bucket, so the engine keeps no second copy."""

import pytest
import torch

from tests.distributed.workloads import TINY_BUCKET_MB, global_batch, make_net, mse
from tests.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.quick]


def gradient_storages(rank: int, world_size: int, set_to_none: bool) -> list[dict]:
    """Per step: which storage each parameter's gradient lives in, and the bucket assignment."""
    import hsync

    # Buckets of about 300 bytes: several of them, some holding several parameters.
    cap_mb = 3 * TINY_BUCKET_MB
    model = hsync.WeightedDDP(make_net(seed=0), bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb,
                              gradient_as_bucket_view=True)
    params = [p for p in model.module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    steps = []
    for step in range(4):
        _, _, slices = global_batch(step, [3, 5][:world_size])
        x, y = slices[rank]
        model.backward(mse(model(x, use_branch=True), y), weight=len(x))
        steps.append({"storage": [None if p.grad is None else p.grad.untyped_storage().data_ptr() for p in params],
                      "buckets": model.bucket_params})
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return steps


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_into_their_bucket(set_to_none):
    for rank, steps in enumerate(run_ranks(gradient_storages, 2, set_to_none)):
        for index, step in enumerate(steps):
            storage, buckets = step["storage"], step["buckets"]
            assert len(buckets) >= 3, "the small cap should give several buckets"
            shared = [[storage[i] for i in bucket if storage[i] is not None] for bucket in buckets]
            used = [set(s) for s in shared if s]
            assert max(len(s) for s in shared) >= 2, "no bucket holds two gradients: the check below shows nothing"
            assert all(len(s) == 1 for s in used), f"rank {rank}, step {index}: a bucket's gradients are not one buffer"
            assert len({next(iter(s)) for s in used}) == len(used), f"rank {rank}, step {index}: buckets share a buffer"
        # From the second step on the buckets are final: the gradients stay in the same buffers.
        assert steps[1]["storage"] == steps[-1]["storage"], f"rank {rank}: gradients moved after the rebuild"


class Strided(torch.nn.Module):
    """A channels_last convolution and a transposed weight: parameters dense but not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.w = torch.nn.Parameter(torch.randn(4, 8).t())  # strides (1, 8)
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.out(self.conv(x).flatten(1)) @ self.w


def strided_batch(step: int, rank: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(2 + rank, 3, 6, 6, generator=g).to(device, memory_format=torch.channels_last)


def strided_steps(rank: int, world_size: int, wrap_name: str, views: bool, contiguous_first_grad: bool,
                  device: str = "cpu"):
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cudnn.allow_tf32 = False  # cuDNN's convolutions default to TF32; the reference is float32
    wrap = {"ddp": torch.nn.parallel.DistributedDataParallel, "hsync": hsync.WeightedDDP}[wrap_name]
    torch.manual_seed(0)
    net = Strided().to(device)
    if contiguous_first_grad:  # a gradient of another layout than its parameter's, accumulated into
        net.conv.weight.grad = torch.zeros(net.conv.weight.shape, device=device)
    model = wrap(net, gradient_as_bucket_view=views)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)  # reads .grad with the param's strides
    for step in range(3):
        model(strided_batch(step, rank, device)).pow(2).mean().backward()
        optimizer.step()
        if step < 2:
            optimizer.zero_grad(set_to_none=False)
    return ({name: p.detach().cpu() for name, p in net.named_parameters()},
            {name: (tuple(p.grad.stride()), tuple(p.stride())) for name, p in net.named_parameters()})


def strided_reference(world_size: int = 2) -> dict[str, torch.Tensor]:
    """strided_steps' parameters in one process: each step's gradient, the mean of the ranks' mean losses'."""
    torch.manual_seed(0)
    net = Strided()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, fused=True)
    for step in range(3):
        optimizer.zero_grad()
        (sum(net(strided_batch(step, rank)).pow(2).mean() for rank in range(world_size)) / world_size).backward()
        optimizer.step()
    return {name: p.detach() for name, p in net.named_parameters()}


@pytest.mark.parametrize(("views", "contiguous_first_grad"), [(True, False), (False, False), (False, True)],
                         ids=["views", "copied", "copied-contiguous-grad"])
def test_channels_last_and_transposed_parameters_train_as_with_ddp(views, contiguous_first_grad):
    # As bucket views their gradients were contiguous where the parameters are not: a fused AdamW stepped each
    # element with another's gradient, 0.058 away from DDP's parameters after three steps.
    ddp = run_ranks(strided_steps, 2, "ddp", views, contiguous_first_grad)
    ours = run_ranks(strided_steps, 2, "hsync", views, contiguous_first_grad)
    reference = strided_reference()  # the GPU check's, checked here against DDP's
    for rank, ((params, strides), (ddp_params, ddp_strides)) in enumerate(zip(ours, ddp, strict=True)):
        assert strides == ddp_strides, f"rank {rank}: hsync's gradient strides {strides}, DDP's {ddp_strides}"
        for name, value in params.items():
            torch.testing.assert_close(value, ddp_params[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")
            if not contiguous_first_grad:  # a fused AdamW misreads that gradient, DDP's too
                torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")
