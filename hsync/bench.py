"""Benchmarks hsync.WeightedDDP against torch DDP and against no synchronisation, side by side.

    python -m hsync.bench --device cpu --world-size 2 --json results.json --plot results.png
    python -m hsync.bench --device cuda --world-size 1 ...      # one GPU per rank, NCCL

Every workload times interleaved rounds of its variants (hsync weighted, hsync plain, torch DDP, no
sync) in the same processes, on the same model, data and seed, so machine noise falls on all of them
alike. Then it measures each variant's peak memory on its own. It spawns the ranks itself, or runs
under torchrun when RANK is set.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cache, partial

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import DeviceType
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from transformers import BertConfig, BertForPreTraining

import hsync
from hsync.balance import SimulatedSlowdown

MIB = 1024 * 1024
NAN = float("nan")
# hsync: WeightedDDP with model.backward(loss, weight=n), the exact weighted step; hsync_plain: the same
# wrapper with loss.backward(), DDP's own semantics; nosync: the bare model, the floor.
VARIANTS = ("hsync", "hsync_plain", "ddp", "nosync")
LABELS = {"hsync": "hsync, backward(loss, weight)", "hsync_plain": "hsync, loss.backward()", "ddp": "torch DDP",
          "nosync": "no sync"}
MEMORY_VARIANTS = ("hsync", "ddp", "nosync")  # hsync_plain keeps the same buffers as hsync


@dataclass
class Result:
    """One workload's numbers; step times are medians and 90th percentiles over timed steps."""

    workload: str
    hsync_step_s: float
    ddp_step_s: float
    nosync_step_s: float
    hsync_p90_s: float
    ddp_p90_s: float
    nosync_p90_s: float
    samples_per_step: int
    hsync_plain_step_s: float = NAN
    hsync_plain_p90_s: float = NAN
    ratio_vs_ddp: float = 0.0
    plain_ratio_vs_ddp: float = 0.0
    hsync_overhead_vs_nosync: float = 0.0
    ddp_overhead_vs_nosync: float = 0.0
    peak_memory_mb: dict[str, float] = field(default_factory=dict)
    """Per variant: peak MiB of live tensors in a training step, plus what wrapping the model kept
    (buckets), over the bare model's parameters (see training_memory_mb)."""
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ratio_vs_ddp = self.hsync_step_s / self.ddp_step_s
        self.plain_ratio_vs_ddp = self.hsync_plain_step_s / self.ddp_step_s
        self.hsync_overhead_vs_nosync = self.hsync_step_s / self.nosync_step_s - 1
        self.ddp_overhead_vs_nosync = self.ddp_step_s / self.nosync_step_s - 1


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    samples: int
    bucket_cap_mb: float = 25.0
    bucket_views: bool = False
    """Gradients as views into the buckets (gradient_as_bucket_view), for hsync and DDP alike. Gradients
    are then zeroed in place rather than dropped after each step, as loops that keep them do: the buckets
    are the gradients, so keeping them costs nothing more."""
    comm_dtype: torch.dtype | None = None
    """Gradients travel in this dtype: hsync's comm_dtype against DDP with torch's matching compression
    hook (bf16_compress_hook / fp16_compress_hook)."""


def bert_workload(name: str, hidden: int, layers: int, batch: int, seq: int, device: torch.device,
                  bucket_cap_mb: float = 25.0, bucket_views: bool = False,
                  comm_dtype: torch.dtype | None = None) -> Workload:
    vocab = 8000
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                        max_position_embeddings=seq)

    def make_batch(g: torch.Generator) -> tuple:
        return masked_batch(g, batch, seq, vocab, device)

    def loss(model: nn.Module, b: tuple) -> torch.Tensor:
        # Masked LM + next-sentence prediction, as in pretraining: every parameter gets a gradient.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=b[0])
        mlm = nn.functional.cross_entropy(out.prediction_logits.float().flatten(0, 1), b[1].flatten())
        return mlm + nn.functional.cross_entropy(out.seq_relationship_logits.float(), b[2])

    return Workload(name, lambda: BertForPreTraining(config).to(device), make_batch, loss, batch, bucket_cap_mb,
                    bucket_views, comm_dtype)


def masked_batch(g: torch.Generator, batch: int, seq: int, vocab: int, device: torch.device) -> tuple:
    """Random token ids, 15% of them to predict, and random next-sentence labels."""
    ids = torch.randint(vocab, (batch, seq), generator=g)
    labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, -100)
    nsp = torch.randint(2, (batch,), generator=g)
    return ids.to(device), labels.to(device), nsp.to(device)


class GradientMover(nn.Module):
    """Many parameter tensors of mixed sizes and little compute: per-gradient overhead dominates."""

    def __init__(self, count: int = 600) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(4 + (i * 37) % 250) * 0.01) for i in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w.sum() for w in self.weights), x.sum())


def mover_workload(device: torch.device, count: int) -> Workload:
    return Workload(f"gradient-mover-{count}", lambda: GradientMover(count).to(device),
                    lambda g: (torch.randn(8, generator=g).to(device),), lambda m, b: m(b[0]), 8)


def finish_step(net: nn.Module, loss: torch.Tensor, weight: int | None, opt: torch.optim.Optimizer,
                device: torch.device, keep_grads: bool = False) -> None:
    """Backward (weighted through hsync when a weight is given), optimizer step, and on GPU a sync."""
    if weight is None:
        loss.backward()
    else:
        net.backward(loss, weight=weight)
    opt.step()
    opt.zero_grad(set_to_none=not keep_grads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wrap(variant: str, net: nn.Module, workload: Workload, device: torch.device) -> nn.Module:
    if variant in ("hsync", "hsync_plain"):
        return hsync.WeightedDDP(net, bucket_cap_mb=workload.bucket_cap_mb,
                                 gradient_as_bucket_view=workload.bucket_views, comm_dtype=workload.comm_dtype)
    if variant == "ddp":
        return ddp_with_hook(DistributedDataParallel(net, bucket_cap_mb=workload.bucket_cap_mb,
                                                     device_ids=[device.index] if device.type == "cuda" else None,
                                                     gradient_as_bucket_view=workload.bucket_views),
                             workload.comm_dtype)
    return net


def ddp_with_hook(model: DistributedDataParallel, comm_dtype: torch.dtype | None) -> DistributedDataParallel:
    """DDP communicating in `comm_dtype` through torch's own compression hook (None: no hook)."""
    if comm_dtype is not None:
        hooks = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}
        model.register_comm_hook(None, hooks[comm_dtype])
    return model


def train_step(variant: str, workload: Workload, net: nn.Module, opt: torch.optim.Optimizer, batch: tuple,
               device: torch.device) -> None:
    loss = workload.loss(net, batch)
    finish_step(net, loss, workload.samples if variant == "hsync" else None, opt, device, workload.bucket_views)


def time_variants(workload: Workload, rounds: int, steps: int, device: torch.device) -> Result:
    """Interleaved rounds: each round runs `steps` timed steps of every variant in turn."""
    rank = dist.get_rank()
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        net = wrap(variant, workload.make_model(), workload, device)
        models[variant] = (net, torch.optim.SGD(net.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    batches = [workload.make_batch(g) for _ in range(4)]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_index in range(rounds + 1):  # round 0 warms up (and lets hsync rebuild its buckets)
        for variant, (net, opt) in models.items():
            for step in range(steps):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                train_step(variant, workload, net, opt, batches[step % len(batches)], device)
                if round_index:
                    times[variant].append(time.perf_counter() - started)
    ours = models["hsync"][0]
    params = [p for p in ours.module.parameters() if p.requires_grad]  # what bucket_params indexes
    largest_bucket = max(sum(params[i].numel() * (workload.comm_dtype or params[i].dtype).itemsize for i in bucket)
                         for bucket in ours.bucket_params)
    del models, ours, params
    measurable = device.type == "cuda" or _mallinfo2() is not None
    memory = torch.tensor([training_memory_mb(v, workload, batches, device) for v in MEMORY_VARIANTS]
                          if measurable else [NAN] * len(MEMORY_VARIANTS))
    # Every rank's step is as slow as the slowest rank's: take the max over ranks, step by step.
    stacked = torch.tensor([times[v] for v in VARIANTS], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    med = {v: statistics.median(stacked[i].tolist()) for i, v in enumerate(VARIANTS)}
    p90 = {v: statistics.quantiles(stacked[i].tolist(), n=10)[-1] for i, v in enumerate(VARIANTS)}
    return Result(workload.name, med["hsync"], med["ddp"], med["nosync"], p90["hsync"], p90["ddp"], p90["nosync"],
                  workload.samples * dist.get_world_size(), med["hsync_plain"], p90["hsync_plain"],
                  peak_memory_mb=dict(zip(MEMORY_VARIANTS, memory.tolist(), strict=True)) if measurable else {},
                  extra={"largest_bucket_mib": largest_bucket / MIB})


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
            train_step(variant, workload, net, opt, batch, device)

    train(batches[:2])
    kept = live_bytes(device) - before
    return (kept + peak_bytes_during(lambda: train(batches[:3]), device)) / MIB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def live_bytes(device: torch.device) -> int:
    """Bytes of live tensors on `device`; on the CPU, every byte malloc has handed out, on every thread
    (glibc's mallinfo2: torch's CPU tensors come from malloc)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


@cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    """glibc's mallinfo2, looked up once; None elsewhere (macOS, musl), where CPU memory goes unmeasured."""
    function = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if function is not None:
        function.restype = _Mallinfo2
    return function


def peak_bytes_during(fn: Callable[[], None], device: torch.device) -> int:
    """Runs fn(); returns the peak bytes of tensors on `device` during it over those alive before."""
    if device.type == "cuda":
        start = live_bytes(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    # The profiler records each allocation and free through torch's CPU allocator on the threads it
    # follows (this one and autograd's). Within steps every transient is made and freed there; what
    # the communicators' threads hold lives across steps and is counted by live_bytes instead.
    gc.collect()  # garbage of earlier work freed inside fn would count against it
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


class Gradients(nn.Module):
    """Parameters whose forward returns a view of each: backward hands the given gradients straight to
    the sync hooks, with no compute to hide the reduction behind."""

    def __init__(self, count: int, numel: int, device: torch.device) -> None:
        super().__init__()
        self.tensors = nn.ParameterList(nn.Parameter(torch.zeros(numel, device=device)) for _ in range(count))

    def forward(self) -> list[torch.Tensor]:
        return [p.view_as(p) for p in self.tensors]


def comm_path(device: torch.device, megabytes: float, rounds: int, comm_dtype: torch.dtype | None = None) -> Result:
    """The reduction alone: hooks + pack + all-reduce + unpack of 64 float32 gradients through hsync and
    through torch DDP (same bucket cap), over the same backward without sync; in the notes, torch's
    all-reduce of the same bytes as one flat tensor (the wire's limit) and tensor by tensor, and, on
    GPU, a device-to-device copy (the memory's limit for pack and unpack).

    With a `comm_dtype`, hsync communicates in it and DDP uses torch's matching compression hook; the flat
    all-reduce is then of that dtype, and hsync in float32 runs beside them (`hsync_fp32`), so the gain
    is measured in the same rounds. GB/s count the float32 gradient bytes delivered."""
    numel = int(megabytes * MIB / 4) // 64
    nets = {"hsync": hsync.WeightedDDP(Gradients(64, numel, device), comm_dtype=comm_dtype),
            "ddp": ddp_with_hook(DistributedDataParallel(Gradients(64, numel, device)), comm_dtype),
            "nosync": Gradients(64, numel, device)}
    if comm_dtype is not None:
        nets["hsync_fp32"] = hsync.WeightedDDP(Gradients(64, numel, device))
    grads = [torch.ones(numel, device=device) for _ in range(64)]
    flat = torch.cat(grads).to(comm_dtype or torch.float32)
    copy_dst = torch.empty_like(flat)

    def backward_of(net: nn.Module) -> Callable[[], None]:
        def step() -> None:
            torch.autograd.backward(net(), grads)
            net.zero_grad(set_to_none=True)
        return step

    def per_tensor() -> None:
        for work in [dist.all_reduce(g, async_op=True) for g in grads]:
            work.wait()

    steps = {name: backward_of(net) for name, net in nets.items()}
    steps |= {"flat": lambda: dist.all_reduce(flat), "per_tensor": per_tensor}
    if device.type == "cuda":
        steps["copy"] = lambda: copy_dst.copy_(flat)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for round_index in range(rounds + 1):
        for name, fn in steps.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_index:
                times[name].append(time.perf_counter() - started)
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in times.items()}
    gbytes = 64 * numel * 4 / 1e9

    def delivered(variant: str) -> float:
        return gbytes / max(med[variant] - med["nosync"], 1e-9)

    extra = {"hsync_buckets": len(nets["hsync"].bucket_params), "hsync_gb_per_s": delivered("hsync"),
             "ddp_gb_per_s": delivered("ddp"), "torch_flat_gb_per_s": gbytes / med["flat"],
             "torch_per_tensor_gb_per_s": gbytes / med["per_tensor"]}
    if "hsync_fp32" in med:
        extra |= {"hsync_fp32_gb_per_s": delivered("hsync_fp32"),
                  "gb_per_s_vs_hsync_fp32": delivered("hsync") / delivered("hsync_fp32")}
    if "copy" in med:
        extra["device_copy_gb_per_s"] = 2 * flat.nbytes / 1e9 / med["copy"]  # read + write
    return Result(f"comm-path-{megabytes:g}MiB{_dtype_suffix(comm_dtype)}", med["hsync"], med["ddp"], med["nosync"],
                  p90["hsync"], p90["ddp"], p90["nosync"], 0, extra=extra)


def _dtype_suffix(comm_dtype: torch.dtype | None) -> str:
    return {None: "", torch.bfloat16: "-bf16", torch.float16: "-fp16"}[comm_dtype]


def mixed_speeds(name: str, device: torch.device, slowdowns: list[float], rounds: int, steps: int,
                 quick: bool) -> Result:
    """Ranks slowed down by `slowdowns` (SimulatedSlowdown: rank r's steps take slowdowns[r] times its
    work): hsync.Balancer planning from measurements against DDP with equal batches, in samples per
    second. Rounds of each alternate; the first step of a round, which carries the switch, is not timed.

    If every step of a rank takes f_r times its work, the best split finishes all ranks together and
    beats DDP's by max(f) * sum(1 / f) / world, whatever the fixed part of a step (`ideal_speedup`),
    on independent devices. Ranks on a CPU share its cores: at that split they would compute
    sum(1 / f) cores' worth at once, and with fewer cores the best is less (`cores_bound_speedup`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(slowdowns) != world:
        raise ValueError(f"{len(slowdowns)} slowdowns for {world} ranks")
    hidden, layers, batch, seq = (32, 1, 4, 32) if quick else (128, 2, 32, 64)
    workload = bert_workload("mixed", hidden, layers, batch, seq, device)
    global_batch = workload.samples * world
    pool = masked_batch(torch.Generator().manual_seed(0), 8 * global_batch, seq, 8000, device)  # alike everywhere

    # BERT's buffers are constants: broadcasting them would only add a meeting point to each step.
    torch.manual_seed(0)
    ours = hsync.WeightedDDP(workload.make_model(), forward_sync_buffers=False)
    torch.manual_seed(0)
    theirs = DistributedDataParallel(workload.make_model(), forward_sync_buffers=False)
    balancer = hsync.Balancer(ours, len(pool[0]), hsync.BalanceConfig(
        global_batch_size=global_batch, replan_every=10, simulate_slowdown=slowdowns[rank]))
    ddp_slowdown = SimulatedSlowdown(slowdowns[rank], device)
    optimizers = {"hsync": torch.optim.SGD(ours.parameters(), lr=1e-4),
                  "ddp": torch.optim.SGD(theirs.parameters(), lr=1e-4)}

    def micro_batches() -> Iterator[list[int]]:
        while True:
            yield from balancer

    hsync_batches = micro_batches()
    ddp_cursor = 0

    def hsync_step() -> None:
        while True:
            indices = next(hsync_batches)
            loss = workload.loss(ours, tuple(t[indices] for t in pool))
            if balancer.backward(loss) is not None:
                break
        optimizers["hsync"].step()
        optimizers["hsync"].zero_grad()

    def ddp_step() -> None:
        nonlocal ddp_cursor
        share = workload.samples
        start = (ddp_cursor + rank * share) % len(pool[0])
        ddp_cursor += global_batch
        loss = workload.loss(theirs, tuple(t[start:start + share] for t in pool))
        ddp_slowdown.pause_ahead()  # before the backward, which ends with the reduction
        loss.backward()
        optimizers["ddp"].step()
        optimizers["ddp"].zero_grad()
        ddp_slowdown.step_done()

    def timed(step: Callable[[], None], count: int) -> list[float]:
        slowdown = balancer.slowdown if step is hsync_step else ddp_slowdown
        slowdown.restart()  # the other variant's work is no part of this one's first step
        step()  # the switch from the other variant's round
        times, started = [], time.perf_counter()
        for _ in range(count):
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            times.append(now - started)
            started = now
        return times

    # Warm-up: the balancer's warm-up and probe steps and its measurement of the equal split, until
    # the plan from measurements is in force.
    while balancer.decisions < 2:
        hsync_step()
    for _ in range(2):
        hsync_step()
    first_plan = balancer.planned_split()
    timed(ddp_step, 2)
    times: dict[str, list[float]] = {"hsync": [], "ddp": []}
    for _ in range(rounds):
        times["hsync"] += timed(hsync_step, steps)
        times["ddp"] += timed(ddp_step, steps)
    stacked = torch.tensor([times["hsync"], times["ddp"]], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)  # a step lasts as long as on its slowest rank
    hs, dd = (statistics.median(row.tolist()) for row in stacked)
    hs90, dd90 = (statistics.quantiles(row.tolist(), n=10)[-1] for row in stacked)
    extra = {"hsync_samples_per_s": global_batch / hs, "ddp_samples_per_s": global_batch / dd,
             "speedup_vs_ddp": dd / hs, "ideal_speedup": max(slowdowns) * sum(1 / f for f in slowdowns) / world}
    if device.type == "cpu":
        # At the ideal split rank r computes 1 / f_r of the time: ranks sharing too few cores cannot.
        demand = sum(1 / f for f in slowdowns) / (os.cpu_count() or 1)
        extra["cores_bound_speedup"] = extra["ideal_speedup"] / max(1.0, demand)
    extra |= {f"first_plan_rank{r}": n for r, n in enumerate(first_plan)}
    extra |= {f"plan_rank{r}": n for r, n in enumerate(balancer.last_plan)}
    return Result(name, hs, dd, NAN, hs90, dd90, NAN, global_batch, extra=extra)


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "hsync": hsync.__version__, "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "world_size": dist.get_world_size(), "backend": dist.get_backend(), "device": device.type,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   nccl=hsync._C.nccl_version())
    return env


@dataclass
class Job:
    name: str
    world: int | None
    """Ranks it needs; None: --world-size."""
    run: Callable[[], Result]


def plan_jobs(args: argparse.Namespace, device: torch.device) -> list[Job]:
    """Every workload the options select, in the order they run."""
    if args.quick:
        plan = [("bert", dict(name="bert-micro", hidden=32, layers=1, batch=4, seq=32)), ("mover", 50),
                ("bert", dict(name="bert-micro-bucket-views", hidden=32, layers=1, batch=4, seq=32,
                              bucket_views=True))]
        caps, comm_mb = [1.0], [1.0]
    elif device.type == "cuda":
        base = dict(hidden=768, layers=12, batch=32, seq=128)
        plan = [("bert", dict(name="bert-base", **base)), ("mover", 600),
                ("bert", dict(name="bert-base-bucket-views", bucket_views=True, **base)),
                ("bert", dict(name="bert-base-bf16", comm_dtype=torch.bfloat16, **base))]
        caps, comm_mb = [1, 5, 25, 100], [64.0, 256.0]
    else:
        mini = dict(hidden=256, layers=4, batch=8, seq=64)
        plan = [("bert", dict(name="bert-tiny", hidden=64, layers=2, batch=8, seq=64)),
                ("bert", dict(name="bert-mini", **mini)), ("mover", 600),
                ("bert", dict(name="bert-mini-bucket-views", bucket_views=True, **mini)),
                ("bert", dict(name="bert-mini-bf16", comm_dtype=torch.bfloat16, **mini))]
        caps, comm_mb = [1, 5, 25, 100], [16.0]
    sweep_spec = dict(plan[0][1]) if args.quick else (dict(hidden=256, layers=4, batch=8, seq=64)
                                                       if device.type == "cpu" else dict(plan[0][1]))
    sweep_spec.pop("name", None)
    jobs = []
    for kind, spec in plan:
        workload = bert_workload(device=device, **spec) if kind == "bert" else mover_workload(device, spec)
        jobs.append(Job(workload.name, None, partial(time_variants, workload, args.rounds, args.steps, device)))
    for cap in caps:
        workload = bert_workload(f"bucket-cap-{cap:g}MiB", device=device, bucket_cap_mb=cap, **sweep_spec)
        jobs.append(Job(workload.name, None, partial(time_variants, workload, args.rounds, args.steps, device)))
    for mb in comm_mb:
        for comm_dtype in (None, torch.bfloat16):
            jobs.append(Job(f"comm-path-{mb:g}MiB{_dtype_suffix(comm_dtype)}", None,
                            partial(comm_path, device, mb, args.rounds * args.steps, comm_dtype)))
    for name, slowdowns in (("mixed-speeds-2x", [1.0, 2.0]), ("mixed-speeds-1-1-2-4", [1.0, 1.0, 2.0, 4.0]),
                            ("equal-speeds-auto", [1.0, 1.0])):
        jobs.append(Job(name, len(slowdowns), partial(mixed_speeds, name, device, slowdowns, args.rounds,
                                                               args.steps, args.quick)))
    return [job for job in jobs if not args.only or any(pattern in job.name for pattern in args.only)]


def run_jobs(args: argparse.Namespace) -> dict:
    """Runs, on every rank of this world, the selected jobs that need as many ranks as it has; returns the
    results (on rank 0) with the environment."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = []
    for job in plan_jobs(args, device):
        if (job.world or args.world_size) == world:
            results.append(job.run())
            report(rank, results[-1])
    # NaN (no floor for this workload) is not JSON: it is written as null.
    return {"env": environment(device),
            "results": [{k: None if v != v else v for k, v in asdict(r).items()} | {"world_size": world}
                        for r in results]}


def write_outputs(args: argparse.Namespace, output: dict) -> None:
    print("\n" + "\n".join(table(output)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f, indent=1)
    if args.plot:
        plot(output, args.plot)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(output, args))


def report(rank: int, result: Result) -> None:
    if rank == 0:
        print(f"  {result.workload}: hsync {_ms(result.hsync_step_s)} ms, plain {_ms(result.hsync_plain_step_s)} ms, "
              f"ddp {_ms(result.ddp_step_s)} ms (ratio {result.ratio_vs_ddp:.3f})", flush=True)


def table(output: dict) -> list[str]:
    env = output["env"]
    lines = [f"hsync {env['hsync']}, torch {env['torch']}, {env['backend']}, {env['world_size']} ranks, "
             f"{env.get('gpu', env['cpu'])}",
             "| workload | hsync p50 (p90) ms | hsync plain ms | DDP p50 (p90) ms | no-sync ms | hsync/DDP | "
             "plain/DDP | hsync over floor | DDP over floor | hsync samples/s | peak MiB hsync / DDP / no-sync | "
             "notes |",
             "|" + " --- |" * 12]
    for r in output["results"]:
        notes = ", ".join(f"{k} {v:.3g}" for k, v in r["extra"].items())
        memory = " / ".join(f"{r['peak_memory_mb'][v]:.1f}" for v in MEMORY_VARIANTS) if r["peak_memory_mb"] else "-"
        ranks = r.get("world_size", env["world_size"])
        name = r["workload"] + (f" ({ranks} ranks)" if ranks != env["world_size"] else "")
        lines.append(f"| {name} | {r['hsync_step_s'] * 1e3:.2f} ({r['hsync_p90_s'] * 1e3:.2f}) | "
                     f"{_ms(r['hsync_plain_step_s'])} | {r['ddp_step_s'] * 1e3:.2f} ({r['ddp_p90_s'] * 1e3:.2f}) | "
                     f"{_ms(r['nosync_step_s'])} | {r['ratio_vs_ddp']:.3f} | {_ratio(r['plain_ratio_vs_ddp'])} | "
                     f"{_pct(r['hsync_overhead_vs_nosync'])} | {_pct(r['ddp_overhead_vs_nosync'])} | "
                     f"{r['samples_per_step'] / r['hsync_step_s'] if r['samples_per_step'] else 0:.0f} | {memory} | "
                     f"{notes} |")
    return lines


def markdown(output: dict, args: argparse.Namespace) -> str:
    """A results page: the command that made it, where and when it ran, the table and the plot."""
    env = output["env"]
    options = [f"--device {args.device}", f"--world-size {env['world_size']}", f"--rounds {args.rounds}",
               f"--steps {args.steps}"] + (["--quick"] if args.quick else [])
    if args.only:
        options.append("--only " + " ".join(args.only))
    where = env.get("gpu", env["cpu"]) + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if "cuda" in env else
                                          f" ({env['cpu_count']} cores)")
    lines = [f"# {env['device'].upper()}, {env['world_size']} ranks over {env['backend']}", "",
             f"Command: `python -m hsync.bench {' '.join(options)}`", "",
             f"Measured {env['date']} on {where}; Python {env['python']}, torch {env['torch']}, hsync {env['hsync']}. "
             f"Medians (p90) of {args.rounds * args.steps} timed steps per variant in {args.rounds} interleaved "
             "rounds, each step the slowest rank's.", "", *table(output)[1:]]
    if any(r["workload"].endswith(("-bf16", "-fp16")) for r in output["results"]):
        lines += ["", "Rows ending in -bf16: hsync with `comm_dtype=torch.bfloat16`, DDP with torch's "
                  "`bf16_compress_hook`; GB/s count the float32 gradient bytes delivered."]
    if args.plot:
        lines += ["", f"![step times relative to no sync]({os.path.basename(args.plot)})"]
    return "\n".join(lines) + "\n"


def _missing(x: float | None) -> bool:
    return x is None or x != x  # NaN in memory, null in JSON


def _pct(x: float | None) -> str:
    return "-" if _missing(x) else f"{100 * x:+.1f}%"


def _ms(x: float | None) -> str:
    return "-" if _missing(x) else f"{x * 1e3:.2f}"


def _ratio(x: float | None) -> str:
    return "-" if _missing(x) else f"{x:.3f}"


def plot(output: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Training steps only: the comm path and mixed-speed rows measure other things.
    rows = [r for r in output["results"] if r["samples_per_step"] and not _missing(r["nosync_step_s"])]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ax.bar([x + (i - (len(VARIANTS) - 1) / 2) * width for x in range(len(rows))],
               [r[f"{variant}_step_s"] / r["nosync_step_s"] for r in rows], width, label=LABELS[variant])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    top = max(r[f"{v}_step_s"] / r["nosync_step_s"] for r in rows for v in VARIANTS)
    ax.set_ylim(0, top * 1.3)  # headroom for the legend
    ax.set_xticks(range(len(rows)), [r["workload"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("step time / no-sync step time")
    env = output["env"]
    ax.set_title(f"{env['world_size']} ranks, {env['backend']}, {env.get('gpu', env['cpu'])[:40]}", fontsize=9)
    ax.legend(ncol=2, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        output = run_jobs(args)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(output, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the memory profiler's own chatter, on every step
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the models run")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn (under torchrun: its world); rows that need another number of "
                             "ranks (mixed-speeds-*) get their own")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per workload (plus a warm-up)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    parser.add_argument("--quick", action="store_true", help="tiny workloads: checks the suite runs, measures little")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run the workloads whose names contain one of these")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of the step times here")
    parser.add_argument("--markdown", help="write a results page (command, environment, table, plot) here")
    args = parser.parse_args(argv)
    for flag in ("world_size", "rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        args.world_size = dist.get_world_size()
        try:
            output = run_jobs(args)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) == 0:
            write_outputs(args, output)
        return
    import socket
    import tempfile

    import torch.multiprocessing as mp

    worlds = sorted({args.world_size} | {job.world for job in plan_jobs(args, torch.device(args.device)) if job.world})
    output: dict = {"env": None, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            path = os.path.join(tmp, f"world-{world}.json")
            mp.spawn(worker, args=(world, port, args, path), nprocs=world)
            with open(path) as f:
                part = json.load(f)
            if world == args.world_size or output["env"] is None:
                output["env"] = part["env"]
            output["results"] += part["results"]
    write_outputs(args, output)


if __name__ == "__main__":
    main()
