"""Where one rank's step goes: hsync's step against the bare model's (the no-sync floor), kernel by kernel.

    python -m hsync.bench.step_profile --device cuda --markdown PROFILE.md

One process, a world of one (nothing overlaps, so every microsecond hsync adds is on the step's path), BERT-base
with gradients as bucket views (the mode of the GPU's 1% target), profiled with torch.profiler for a few steps of
each variant after a warm-up. On a GPU each kernel's device time per step is compared (hsync's pack, NCCL's, the
optimizer's alike); on the CPU each op's own CPU time. The table lists what only hsync's step runs, then what
differs most.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import hsync
from hsync.bench.workloads import GPU_BERT_BASE, Workload, bert_workload, train_step, wrap

ROWS = 20  # in the table, at least (every kernel or op of hsync's own, whatever their number)
SIZES = {"base": GPU_BERT_BASE, "tiny": dict(hidden=64, layers=2, batch=8, seq=32)}


def per_step_times(step: Callable[[], None], steps: int, device: torch.device) -> tuple[dict[str, float], float]:
    """{kernel (GPU) or op (CPU): its own microseconds per step} over `steps` profiled steps, and the wall
    seconds per step."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - started) / steps
    times: dict[str, float] = {}
    for event in prof.key_averages():
        # Kernels on a GPU (an op's own row would count its kernels again); ops on the CPU.
        if event.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU):
            own = event.self_device_time_total if cuda else event.self_cpu_time_total
            times[event.key] = times.get(event.key, 0.0) + own / steps
    return times, wall


def compare(workload: Workload, device: torch.device, steps: int) -> tuple[list[str], dict[str, float]]:
    """Markdown lines comparing hsync's step with the floor's, and their totals (us per step, wall ms)."""
    g = torch.Generator().manual_seed(0)
    batch = workload.make_batch(g)
    measured = {}
    for variant in ("hsync", "nosync"):
        torch.manual_seed(0)
        net = wrap(variant, workload.make_model(), workload, device)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step(net=net, opt=opt, variant=variant) -> None:
            train_step(variant, workload, net, opt, batch)

        for _ in range(3):  # warm-up: hsync's buckets rebuilt, kernels loaded, caches filled
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        measured[variant] = per_step_times(step, steps, device)
        del net, opt
    (ours, our_wall), (floor, floor_wall) = measured["hsync"], measured["nosync"]
    unit = "device" if device.type == "cuda" else "cpu"
    # First what hsync's step runs and the floor's never does (its pack, the collectives), then what both run,
    # by how much it differs: on a GPU that is also where hsync's waits and launches slow the model's kernels.
    own = sorted(set(ours) - set(floor), key=ours.__getitem__, reverse=True)
    shared = sorted(set(floor), key=lambda k: abs(ours.get(k, 0.0) - floor[k]), reverse=True)
    lines = [f"| {'kernel' if device.type == 'cuda' else 'op'} | hsync us/step | floor us/step | difference |",
             "| --- | ---: | ---: | ---: |"]
    for key in own + shared[:max(0, ROWS - len(own))]:
        a, b = ours.get(key, 0.0), floor.get(key, 0.0)
        lines.append(f"| `{key[:90]}` | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    totals = {f"hsync_{unit}_us": sum(ours.values()), f"floor_{unit}_us": sum(floor.values()),
              "hsync_wall_ms": our_wall * 1e3, "floor_wall_ms": floor_wall * 1e3}
    return lines, totals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="base", help="the model and batch")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    parser.add_argument("--markdown", help="write the table here too")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        workload = bert_workload("bert-bucket-views", **SIZES[args.size], device=device, bucket_views=True)
        lines, totals = compare(workload, device, args.steps)
    finally:
        dist.destroy_process_group()
    spec = SIZES[args.size]
    head = [f"# One rank's step, hsync against the no-sync floor ({args.device}, hsync {hsync.__version__}, "
            f"torch {torch.__version__})", "",
            f"BERT hidden {spec['hidden']}, {spec['layers']} layers, {spec['batch']} sequences of {spec['seq']} "
            f"tokens, gradients as bucket views; {args.steps} profiled steps a variant after 3 of warm-up.", "",
            ", ".join(f"{k} {v:.1f}" for k, v in totals.items()), ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
