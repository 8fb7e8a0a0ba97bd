"""Optimizer-state sharding against torch's: hsync.ShardedOptimizer, ZeroRedundancyOptimizer over DDP, FSDP2."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hsync
from hsync.bench.memory import live_bytes, peak_bytes_during
from hsync.bench.result import MIB, NAN, Result, slowest_rank_quantiles
from hsync.collectives import Channels

SHARD_VARIANTS = ("hsync", "zero", "fsdp2", "ddp")


def stack(width: int, layers: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))).to(device)


def shard_throughput(device: torch.device, rounds: int, steps: int, quick: bool) -> Result:
    """AdamW steps of a stack of linear layers on equal ranks through hsync's ShardedOptimizer, torch's
    ZeroRedundancyOptimizer over DDP, FSDP2's fully_shard(reshard_after_forward=False) on each layer (its
    parameters and gradients sharded evenly too) and plain DDP, in interleaved rounds. The row's "hsync"
    and "ddp" are those two; `extra` holds ZeroRedundancyOptimizer's and FSDP2's steps, hsync's speedup
    over each, and each rank's bytes of optimizer state through hsync and ZeroRedundancyOptimizer against
    an even share of the whole."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer  # 0.8 s of TorchScript: only where it runs

    width, layers, batch = (64, 4, 8) if quick else (512, 8, 32)
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = Channels.of_group()
    nets, optimizers, backwards = {}, {}, {}
    for variant in SHARD_VARIANTS:
        net = stack(width, layers, device)
        if variant == "hsync":
            net = hsync.WeightedDDP(net)
            optimizers[variant] = hsync.ShardedOptimizer(net, torch.optim.AdamW, lr=1e-4)
        elif variant == "fsdp2":
            for layer in net:
                fully_shard(layer, reshard_after_forward=False)
            fully_shard(net, reshard_after_forward=False)
            optimizers[variant] = torch.optim.AdamW(net.parameters(), lr=1e-4)
        else:
            net = DistributedDataParallel(net)
            optimizers[variant] = (ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4)
                                   if variant == "zero" else torch.optim.AdamW(net.parameters(), lr=1e-4))
        nets[variant] = net
        backwards[variant] = weighted_backward(net) if variant == "hsync" else (lambda loss: loss.backward())
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(batch, width, generator=g).to(device) for _ in range(4)]
    times: dict[str, list[float]] = {v: [] for v in SHARD_VARIANTS}
    for round_index in range(rounds + 1):  # round 0 warms up (buckets rebuilt, state allocated)
        for variant in SHARD_VARIANTS:
            net, optimizer, backward = nets[variant], optimizers[variant], backwards[variant]
            for step in range(steps):
                channel.barrier("the benchmark's barrier before a timed step")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                backward(net(batches[step % len(batches)]).square().mean())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_index:
                    times[variant].append(time.perf_counter() - started)
    med, p90 = slowest_rank_quantiles(times)
    whole = sum(p.numel() * p.element_size() for p in nets["ddp"].parameters()) * 2  # AdamW's two moments
    held = channel.gather(torch.tensor([state_bytes(optimizers["hsync"].state),
                                        state_bytes(optimizers["zero"].optim.state)], dtype=torch.float64),
                          "the optimizers' state bytes")
    extra = {"zero_step_s": med["zero"], "fsdp2_step_s": med["fsdp2"],
             "speedup_vs_zero": med["zero"] / med["hsync"], "speedup_vs_fsdp2": med["fsdp2"] / med["hsync"],
             "parameters": sum(p.numel() for p in nets["ddp"].parameters())}
    for r in range(world):
        extra[f"state_share_hsync_rank{r}"] = held[r, 0].item() / whole
        extra[f"state_share_zero_rank{r}"] = held[r, 1].item() / whole
    return Result("shard-throughput", med["hsync"], med["ddp"], NAN, p90["hsync"], p90["ddp"], NAN, batch * world,
                  extra=extra)


def weighted_backward(model: hsync.WeightedDDP) -> Callable[[torch.Tensor], None]:
    def backward(loss: torch.Tensor) -> None:
        model.backward(loss, weight=1)
    return backward


def state_bytes(state: dict) -> int:
    """Bytes of the state tensors with a dimension (the moments, not the step counts)."""
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


CAPACITY_SYSTEMS = ("hsync", "zero", "fsdp2", "ddp")
CAPACITY_LAYERS = 4
CAPACITY_BUCKET_MB = 1.0  # every system's buckets (hsync's parameter broadcasts too): small beside the budgets


def shard_capacity(device: torch.device, quick: bool) -> Result:
    """Two ranks with memory budgets 3:1: for each system, the widest stack of CAPACITY_LAYERS linear layers
    (width doubled, then bisected to a multiple of 8) whose AdamW training step stays
    within every rank's budget. Each rank's bytes are measured the same way for every system: what building
    it and one step left alive (parameters, gradients, optimizer state, buckets) plus the peak a further
    step allocates (hsync/bench/memory.py). hsync's ShardedOptimizer is given the budgets;
    ZeroRedundancyOptimizer over DDP and FSDP2 (fully_shard with its defaults: parameters sharded too)
    shard evenly; DDP replicates. All keep gradients in their buckets (gradient_as_bucket_view; FSDP2's
    are sharded)."""
    rank = dist.get_rank()
    small = (2 if quick else 32) * MIB
    budgets = [3 * small, small]
    channel = Channels.of_group()
    widths = {}
    for system in CAPACITY_SYSTEMS:
        def fits(width: int, system: str = system) -> bool:
            peak = step_bytes(system, width, budgets, device)
            return bool(channel.gather(torch.tensor([peak <= budgets[rank]]), f"{system} within budget").all())
        widths[system] = widest(fits)
    params = {system: CAPACITY_LAYERS * (w * w + w) for system, w in widths.items()}
    extra = {f"params_{system}": float(count) for system, count in params.items()}
    extra |= {f"hsync_vs_{system}": params["hsync"] / params[system] for system in CAPACITY_SYSTEMS[1:]}
    extra |= {"budget_rank0_mib": budgets[0] / MIB, "budget_rank1_mib": budgets[1] / MIB}
    return Result("shard-capacity-3to1", NAN, NAN, NAN, NAN, NAN, NAN, 0, extra=extra)


def widest(fits: Callable[[int], bool], step: int = 8, limit: int = 1 << 14) -> int:
    """The largest multiple of `step` that fits (0 if not even 2 * `step`): doubled, then bisected."""
    low = 2 * step
    if not fits(low):
        return 0
    high = low * 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def step_bytes(system: str, width: int, budgets: list[int], device: torch.device) -> int:
    """This rank's bytes for `system` training a stack of `width`: alive after a step, plus a step's peak."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    gc.collect()
    before = live_bytes(device)
    net = stack(width, CAPACITY_LAYERS, device)
    if system == "hsync":
        net = hsync.WeightedDDP(net, gradient_as_bucket_view=True, bucket_cap_mb=CAPACITY_BUCKET_MB)
        try:
            optimizer = hsync.ShardedOptimizer(net, torch.optim.AdamW, memory_budget=budgets, lr=1e-4)
        except ValueError:  # it refuses what its own arithmetic says cannot fit
            return budgets[0] + budgets[1]
    elif system == "fsdp2":
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    else:
        net = DistributedDataParallel(net, gradient_as_bucket_view=True, bucket_cap_mb=CAPACITY_BUCKET_MB)
        optimizer = (ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4) if system == "zero"
                     else torch.optim.AdamW(net.parameters(), lr=1e-4))
    batch = torch.randn(4, width, device=device)

    def step() -> None:
        loss = net(batch).square().mean()
        net.backward(loss, weight=len(batch)) if system == "hsync" else loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state comes with the first step
    kept = live_bytes(device) - before
    return kept + peak_bytes_during(step, device)  # what it built goes with this frame
