"""Optimizer-state sharding against torch's: hsync.ShardedOptimizer, ZeroRedundancyOptimizer over DDP, FSDP2."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import hsync
from hsync.bench.result import NAN, Result
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
    slowest = channel.max_over_ranks(torch.tensor([times[v] for v in SHARD_VARIANTS], dtype=torch.float64),
                                     "the benchmark's step times")
    med = {v: statistics.median(row) for v, row in zip(SHARD_VARIANTS, slowest.tolist(), strict=True)}
    p90 = {v: statistics.quantiles(row, n=10)[-1] for v, row in zip(SHARD_VARIANTS, slowest.tolist(), strict=True)}
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
