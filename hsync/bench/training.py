"""Training-step rows: every variant of a workload in interleaved rounds, then each one's peak memory."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from hsync.bench.memory import live_bytes, measurable, peak_bytes_during
from hsync.bench.result import MEMORY_VARIANTS, MIB, NAN, VARIANTS, Result, slowest_rank_quantiles
from hsync.bench.workloads import Workload, train_step, wrap
from hsync.collectives import Channels


def time_variants(workload: Workload, rounds: int, steps: int, device: torch.device) -> Result:
    """Interleaved rounds: each round runs `steps` timed steps of every variant in turn."""
    rank = dist.get_rank()
    channel = Channels.of_group()
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        net = wrap(variant, workload.make_model(), workload, device)
        models[variant] = (net, torch.optim.SGD(net.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    batches = [workload.make_batch(g) for _ in range(4)]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    floor_queued = []  # the bare model's steps: seconds until the host had queued all of it
    for round_index in range(rounds + 1):  # round 0 warms up (and lets hsync rebuild its buckets)
        for variant, (net, opt) in models.items():
            for step in range(steps):
                channel.barrier("the benchmark's barrier before a timed step")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                train_step(variant, workload, net, opt, batches[step % len(batches)])
                queued = time.perf_counter()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_index:
                    times[variant].append(time.perf_counter() - started)
                    if variant == "nosync":
                        floor_queued.append(queued - started)
    ours = models["hsync"][0]
    params = [p for p in ours.module.parameters() if p.requires_grad]  # what bucket_params indexes
    largest_bucket = max(sum(params[i].numel() * (workload.comm_dtype or params[i].dtype).itemsize for i in bucket)
                         for bucket in ours.bucket_params)
    del models, ours, params
    can_measure = measurable(device)
    memory = torch.tensor([training_memory_mb(v, workload, batches, device) for v in MEMORY_VARIANTS]
                          if can_measure else [NAN] * len(MEMORY_VARIANTS), dtype=torch.float64)
    memory = channel.max_over_ranks(memory, "the benchmark's peak memory")
    med, p90 = slowest_rank_quantiles(times)
    extra = {"largest_bucket_mib": largest_bucket / MIB} | launch_bound(floor_queued, times["nosync"], device)
    return Result(workload.name, med["hsync"], med["ddp"], med["nosync"], p90["hsync"], p90["ddp"], p90["nosync"],
                  workload.samples * dist.get_world_size(), med["hsync_plain"], p90["hsync_plain"],
                  peak_memory_mb=dict(zip(MEMORY_VARIANTS, memory.tolist(), strict=True)) if can_measure else {},
                  extra=extra)


def launch_bound(queued: list[float], steps: list[float], device: torch.device) -> dict[str, float]:
    """On a GPU, how much of the floor's step the host took to queue it (`floor_host_share`, medians): near 1,
    the device waits for kernel launches and the host sets the pace; well below, the step keeps the GPU busy.
    (On the CPU the host does the work: no such share.)"""
    if device.type != "cuda":
        return {}
    return {"floor_host_share": statistics.median(queued) / statistics.median(steps)}


def training_memory_mb(variant: str, workload: Workload, batches: list[tuple], device: torch.device) -> float:
    """Peak MiB of live tensors in a training step of `variant` over the bare model's: what its wrapping
    keeps alive between steps (buckets; kept gradients) plus the step's own peak.

    Measured on a fresh model, so that only this variant's buffers count, and after two warm-up steps,
    so that one-off transients (the broadcast of rank 0's parameters, the bucket rebuild) do not."""
    torch.manual_seed(0)
    bare = workload.make_model()
    before = live_bytes(device)
    net = wrap(variant, bare, workload, device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def train(batches: list[tuple]) -> None:
        for batch in batches:
            train_step(variant, workload, net, opt, batch)

    train(batches[:2])
    kept = live_bytes(device) - before
    return (kept + peak_bytes_during(lambda: train(batches[:3]), device)) / MIB
