"""The reduction alone, against DDP and the wire's own limit."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hsync
from hsync.bench.result import MIB, NAN, Result
from hsync.bench.workloads import ddp_with_hook, dtype_suffix


class Gradients(nn.Module):
    """Parameters whose forward returns a view of each: backward hands the given gradients straight to
    the sync hooks, with no compute to hide the reduction behind."""

    def __init__(self, count: int, numel: int, device: torch.device) -> None:
        super().__init__()
        self.tensors = nn.ParameterList(nn.Parameter(torch.zeros(numel, device=device)) for _ in range(count))

    def forward(self) -> list[torch.Tensor]:
        return [p.view_as(p) for p in self.tensors]


# Note [The CPU comm path's limit]
# With gradients copied (not bucket views), every byte of a gradient passes memory three times besides the
# all-reduce: autograd writes it, the pack reads it and writes the bucket (scaled, checked for inf and NaN),
# and the write-back reads the reduced bucket and writes the gradient. The first is the backward's own (the
# no-sync floor has it); the other two are the comm path's and cannot overlap the all-reduce where, as on a CPU,
# the ranks' cores move the all-reduce's bytes themselves. So the comm path's rate is at most
# flat / (flat + pack + write-back), each pass at least a copy's time. On the 2-core development VM
# (2026-11-27, 2 gloo ranks, one thread each, 16 MiB): the flat all-reduce 16 ms, a copy of 16 MiB 2.9 ms,
# the pack 3.6 ms, the write-back 2.9 ms: at most 16 / (16 + 6.5) = 71% of the flat all-reduce's rate;
# hsync reached 56-57% in three runs and torch DDP, which does the same passes, 54-58% (`hsync_of_flat`,
# `ddp_of_flat`; benchmarks/results/2026-11-27-comm-path.md).
# Nor can the passes hide behind the all-reduce there: gloo's flat all-reduce keeps 66-75% of a core busy on
# each rank (`flat_cpu_per_rank`, 2026-11-28, when the bound above read 78-79% with that day's faster copies,
# and hsync reached 59-76%), two ranks share two cores, and smaller buckets, which would let one bucket's pack
# overlap the last one's all-reduce, measured no faster (caps of 8, 4, 2 and 1 MiB against 25: 0.57-0.74 of the
# flat rate against 0.72, in one run).
# Bucket views with gradients set to None between steps save the write-back: the pack copies each gradient into
# its slot, which stays the gradient, one pass instead of two. With gradients zeroed in place instead, autograd
# adds each into its slot (a read-modify-write pass) and the pack scales the slot in place: nothing is saved.
# Measured with views (`hsync_views_of_flat`, 2026-11-29, three runs): 0.72-0.82 of the flat rate, where that
# one pass, timed alone, bounds it at 0.88-0.91 and the copied path read 0.68-0.69 against its bound of 0.79-0.82
# (benchmarks/results/2026-11-29-comm-path-views.md).
# Timed alone, a pass flatters the bound: in a step it reads what autograd just wrote, on ranks that then wait
# for the slower one's pass. So the row also times that pass in place (`one_pass`: the backward without sync,
# each gradient copied into one flat buffer, the buffer all-reduced: no hook, no scale, no check), the least any
# path that reads each gradient once can take. Three runs later that day: it reached 0.73-0.83 of the flat rate,
# and hsync with views 0.99-1.02 of it (`hsync_views_of_one_pass`; 0.74-0.85 of the flat rate).


def comm_path(device: torch.device, megabytes: float, rounds: int, comm_dtype: torch.dtype | None = None) -> Result:
    """The reduction alone: hooks + pack + all-reduce + unpack of 64 float32 gradients through hsync and
    through torch DDP (same bucket cap), over the same backward without sync, and each over the flat all-reduce's
    rate (`*_of_flat`: Note [The CPU comm path's limit]), hsync also with bucket views (`hsync_views`, in
    float32), which saves the unpack, against the least a path that reads each gradient once can take
    (`one_pass`: each copied into one flat buffer, which is all-reduced); in the notes, torch's
    all-reduce of the same bytes as one flat tensor (the wire's limit) and tensor by tensor, a copy of
    the flat tensor (the memory's limit), and hsync's scale-and-pack kernel alone over all the
    gradients as one tensor, against that copy (`pack_vs_copy`, in GB/s read and written; unpacking is
    torch's own copy). The pack is timed as one tensor because 64 launches of a few microseconds of
    work each would time the launches: in a backward they overlap the compute.

    With a `comm_dtype`, hsync communicates in it and DDP uses torch's matching compression hook; the flat
    all-reduce is then of that dtype, and hsync in float32 runs beside them (`hsync_fp32`), so the gain
    is measured in the same rounds. GB/s count the float32 gradient bytes delivered."""
    numel = int(megabytes * MIB / 4) // 64
    nets = {"hsync": hsync.WeightedDDP(Gradients(64, numel, device), comm_dtype=comm_dtype),
            "ddp": ddp_with_hook(DistributedDataParallel(Gradients(64, numel, device)), comm_dtype),
            "nosync": Gradients(64, numel, device)}
    if comm_dtype is None:  # the same path without the write-back (Note [The CPU comm path's limit])
        nets["hsync_views"] = hsync.WeightedDDP(Gradients(64, numel, device), gradient_as_bucket_view=True)
    if comm_dtype is not None:
        nets["hsync_fp32"] = hsync.WeightedDDP(Gradients(64, numel, device))
    grads = [torch.ones(numel, device=device) for _ in range(64)]
    # What the pack pass reads (every gradient, in float32) and writes (the bucket, flags in its tail).
    grads_flat = torch.cat(grads)
    flat = grads_flat.to(comm_dtype or torch.float32, copy=True)
    copy_dst = torch.empty_like(flat)
    bucket = torch.empty(flat.numel() + 2, dtype=flat.dtype, device=device)
    packed, nonfinite_flag, used_flag = bucket[:-2], bucket[-2:-1], bucket[-1:]
    scale = torch.tensor(0.5, dtype=torch.float64, device=device)

    def backward_of(net: nn.Module) -> Callable[[], None]:
        def step() -> None:
            torch.autograd.backward(net(), grads)
            net.zero_grad(set_to_none=True)
        return step

    def per_tensor() -> None:
        for work in [dist.all_reduce(g, async_op=True) for g in grads]:
            work.wait()

    # On a GPU one copy or pack lasts tens of microseconds, no longer than the launch and the sync
    # around it: a run of them back to back is timed there.
    reps = 20 if device.type == "cuda" else 1

    def repeated(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(reps):
                fn()
        return run

    steps = {name: backward_of(net) for name, net in nets.items()}
    if comm_dtype is None:
        # The least that any path which reads each gradient once can take: the backward without sync, each
        # gradient copied into one flat buffer, and that buffer all-reduced (Note [The CPU comm path's limit]).
        one_pass_net, one_pass_buffer = Gradients(64, numel, device), torch.empty(64 * numel, device=device)

        def one_pass() -> None:
            torch.autograd.backward(one_pass_net(), grads)
            for slot, param in zip(one_pass_buffer.split(numel), one_pass_net.parameters(), strict=True):
                slot.copy_(param.grad)
            dist.all_reduce(one_pass_buffer)
            one_pass_net.zero_grad(set_to_none=True)

        steps["one_pass"] = one_pass
    steps |= {"flat": lambda: dist.all_reduce(flat), "per_tensor": per_tensor,
              "copy": repeated(lambda: copy_dst.copy_(flat)),
              "pack": repeated(lambda: hsync._C.scale_and_pack(grads_flat, packed, scale, nonfinite_flag, used_flag))}
    times: dict[str, list[float]] = {k: [] for k in steps}
    flat_cpu: list[float] = []  # this process's CPU seconds (every thread's) in each flat all-reduce
    channel = hsync.collectives.Channels.of_group()
    for round_index in range(rounds + 1):
        for name, fn in steps.items():
            channel.barrier("the benchmark's barrier before a timed step")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started, cpu_started = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_index:
                times[name].append(time.perf_counter() - started)
                if name == "flat":
                    flat_cpu.append(time.process_time() - cpu_started)
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in times.items()}
    gbytes = 64 * numel * 4 / 1e9

    def delivered(variant: str) -> float:
        # With one rank the reduction is nearly free: a time within noise of the floor has no rate.
        spent = med[variant] - med["nosync"]
        return gbytes / spent if spent > 0 else NAN

    variants = [variant for variant in ("hsync", "ddp", "hsync_views", "one_pass") if variant in med]
    extra = {"hsync_buckets": len(nets["hsync"].bucket_params), "torch_flat_gb_per_s": gbytes / med["flat"],
             "torch_per_tensor_gb_per_s": gbytes / med["per_tensor"]}
    extra |= {f"{variant}_gb_per_s": delivered(variant) for variant in variants}
    # Of the wire's own rate (Note [The CPU comm path's limit]).
    extra |= {f"{variant}_of_flat": extra[f"{variant}_gb_per_s"] / extra["torch_flat_gb_per_s"]
              for variant in variants}
    if "one_pass" in med:
        extra["hsync_views_of_one_pass"] = extra["hsync_views_gb_per_s"] / extra["one_pass_gb_per_s"]
    if "hsync_fp32" in med:
        extra |= {"hsync_fp32_gb_per_s": delivered("hsync_fp32"),
                  "gb_per_s_vs_hsync_fp32": delivered("hsync") / delivered("hsync_fp32")}
    if device.type == "cpu":
        # How busy the flat all-reduce keeps one rank's cores: what is left is all the comm path's passes
        # could overlap it with (Note [The CPU comm path's limit]).
        extra["flat_cpu_per_rank"] = statistics.median(flat_cpu) / med["flat"]
    copy_gb_per_s = reps * 2 * flat.nbytes / 1e9 / med["copy"]  # read + write
    pack_gb_per_s = reps * (grads_flat.nbytes + packed.nbytes) / 1e9 / med["pack"]
    extra |= {"copy_gb_per_s": copy_gb_per_s, "pack_gb_per_s": pack_gb_per_s,
              "pack_vs_copy": pack_gb_per_s / copy_gb_per_s}
    return Result(f"comm-path-{megabytes:g}MiB{dtype_suffix(comm_dtype)}", med["hsync"], med["ddp"], med["nosync"],
                  p90["hsync"], p90["ddp"], p90["nosync"], 0, extra=extra)
