"""The command line: which rows run, on how many ranks, spawned here or under torchrun."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import multiprocessing
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from hsync.bench.balancing import AffineCosts, Slowed, mixed_compute, mixed_speeds
from hsync.bench.comm_path import comm_path
from hsync.bench.failover import failover
from hsync.bench.frameworks import framework_mixed
from hsync.bench.report import environment, report, write_outputs
from hsync.bench.result import Result
from hsync.bench.sharding import shard_capacity, shard_throughput
from hsync.bench.training import time_variants
from hsync.bench.workloads import GPU_BERT_BASE, bert_workload, dtype_suffix, mover_workload
from hsync.collectives import end_process_group, put_torch_groups_under_the_deadline

_MAX_RANKS_PER_CORE = 4
_MAX_SIMULATED_RANKS = 16384


@dataclass
class Job:
    name: str
    world: int | None
    """Ranks it needs; None: --world-size."""
    run: Callable[[], Result]
    imports: tuple[str, ...] = ()
    """Modules its ranks import besides the benchmark's: imported once, in the server the ranks are forked from."""


def plan_jobs(args: argparse.Namespace, device: torch.device) -> list[Job]:
    """Every workload the options select, in the order they run."""
    # --quick: every kind of row the default list has, each at its smallest, but the compiled one (a minute of
    # compiling on two cores; its machinery has a test of its own, tests/bench/test_bench_compiled.py).
    if args.quick:
        micro = dict(hidden=32, layers=1, batch=4, seq=32)
        plan = [("bert", dict(name="bert-micro", **micro)), ("mover", 50),
                ("bert", dict(name="bert-micro-bucket-views", bucket_views=True, **micro)),
                ("bert", dict(name="bert-micro-bf16", comm_dtype=torch.bfloat16, **micro)),
                ("bert", dict(name="powersgd-hook", powersgd=True, **micro))]
        caps, comm_mb = [1.0], [1.0]
    elif device.type == "cuda":
        base = GPU_BERT_BASE
        plan = [("bert", dict(name="bert-base", **base)), ("mover", 600),
                ("bert", dict(name="bert-base-bucket-views", bucket_views=True, **base)),
                ("bert", dict(name="bert-base-bf16", comm_dtype=torch.bfloat16, **base)),
                ("bert", dict(name="bert-base-compiled", compiled=True, **base)),
                ("bert", dict(name="powersgd-hook", powersgd=True, **base))]
        caps, comm_mb = [1, 5, 25, 100], [64.0, 256.0]
    else:
        mini = dict(hidden=256, layers=4, batch=8, seq=64)
        plan = [("bert", dict(name="bert-tiny", hidden=64, layers=2, batch=8, seq=64)),
                ("bert", dict(name="bert-mini", **mini)), ("mover", 600),
                ("bert", dict(name="bert-mini-bucket-views", bucket_views=True, **mini)),
                ("bert", dict(name="bert-mini-bf16", comm_dtype=torch.bfloat16, **mini)),
                ("bert", dict(name="bert-mini-compiled", compiled=True, **mini)),
                ("bert", dict(name="powersgd-hook", powersgd=True, **mini))]
        caps, comm_mb = [1, 5, 25, 100], [16.0]
    sweep_spec = dict(plan[0][1]) if args.quick else (dict(hidden=256, layers=4, batch=8, seq=64)
                                                       if device.type == "cpu" else dict(plan[0][1]))
    sweep_spec.pop("name", None)
    # The rows that build a BERT: transformers' BERT (5 s of imports) once in the server, not in every rank.
    bert = ("transformers.models.bert.modeling_bert",)
    jobs = []
    for kind, spec in plan:
        workload = bert_workload(device=device, **spec) if kind == "bert" else mover_workload(device, spec)
        jobs.append(Job(workload.name, None, partial(time_variants, workload, args.rounds, args.steps, device),
                        bert if kind == "bert" else ()))
    for cap in caps:
        workload = bert_workload(f"bucket-cap-{cap:g}MiB", device=device, bucket_cap_mb=cap, **sweep_spec)
        jobs.append(Job(workload.name, None, partial(time_variants, workload, args.rounds, args.steps, device),
                        bert))
    for mb in comm_mb:
        for comm_dtype in (None, torch.bfloat16):
            jobs.append(Job(f"comm-path-{mb:g}MiB{dtype_suffix(comm_dtype)}", None,
                            partial(comm_path, device, mb, args.rounds * args.steps, comm_dtype)))
    jobs.append(Job("shard-throughput", None, partial(shard_throughput, device, args.rounds, args.steps, args.quick)))
    jobs.append(Job("shard-capacity-3to1", 2, partial(shard_capacity, device, args.quick)))
    # Rank 1 2x slower: slowed (its whole step), or costing twice as much per example on top of a fixed cost per
    # step that every rank pays (an affine cost, as real training has: 10 ms per step, 2 and 4 ms per example).
    affine = AffineCosts(fixed_s=0.010, per_example_s=[0.002, 0.004])
    speeds = [("mixed-speeds-2x", Slowed([1.0, 2.0])), ("mixed-speeds-1-1-2-4", Slowed([1.0, 1.0, 2.0, 4.0])),
              ("equal-speeds-auto", Slowed([1.0, 1.0])), ("mixed-affine-2x", affine)]
    if not args.quick:  # the quick run has a row of four ranks already
        speeds.append(("equal-speeds-auto-4", Slowed([1.0] * 4)))
    for name, simulated in speeds:
        jobs.append(Job(name, simulated.world_size, partial(mixed_speeds, name, device, simulated, args.rounds,
                                                            args.steps, args.quick), bert))
    jobs.append(Job("mixed-compute-2x", 2, partial(mixed_compute, "mixed-compute-2x", device, [1, 2], args.rounds,
                                                   args.steps, args.quick), bert))
    for prefix, framework, integration in (("hf-trainer", "trainer", "transformers"),
                                           ("accelerate", "accelerate", "accelerate"),
                                           ("lightning", "lightning", "lightning")):
        for suffix, simulated in (("mixed-2x", Slowed([1.0, 2.0])), ("affine-2x", affine),
                                  ("equal-speeds", Slowed([1.0, 1.0]))):
            name = f"{prefix}-{suffix}"
            jobs.append(Job(name, 2, partial(framework_mixed, name, framework, device, simulated, args.rounds,
                                             args.steps, args.quick), (f"hsync.integrations.{integration}", *bert)))
    if device.type == "cpu" and importlib.util.find_spec("torchft") is not None:  # hsync[torchft]
        jobs.append(Job("failover", 1, partial(failover, args.quick)))
    return [job for job in jobs if not args.only or any(re.search(pattern, job.name) for pattern in args.only)]


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
            # What lives now (torch, the frameworks, earlier rows' leftovers) is not this row's garbage: frozen,
            # the memory measurements' collections skip it (a full collection took 0.4 s on a 2-core machine).
            gc.freeze()
            results.append(job.run())
            report(rank, results[-1])
    # NaN (no floor for this workload, no rate measurable) is not JSON: it is written as null.
    def json_safe(value: object) -> object:
        if isinstance(value, dict):
            return {k: json_safe(v) for k, v in value.items()}
        return None if value != value else value

    return {"env": environment(device),
            "results": [json_safe(asdict(r)) | {"world_size": world} for r in results]}


def run_jobs_in_a_group(args: argparse.Namespace) -> dict:
    """run_jobs on this rank, in the benchmark's group, which ends with it. torch DDP's collectives and the
    reference all-reduces run on that group beside hsync's, so they go under hsync's deadline too: a frozen peer
    ends the run within it, not after torch's 30 minutes."""
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    put_torch_groups_under_the_deadline([dist.GroupMember.WORLD])
    try:
        output = run_jobs(args)
    except BaseException:
        dist.destroy_process_group()  # why not end_process_group: its docstring
        raise
    end_process_group()
    return output


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    # torchrun's environment for one node (Lightning reads GROUP_RANK and LOCAL_WORLD_SIZE too), its agent's
    # store served by the launcher.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # Forked from the fork server, a rank inherits its start method; a launched rank has the platform's, which
    # starts a DataLoader's workers in milliseconds (fork on Linux).
    multiprocessing.set_start_method(None, force=True)
    output = run_jobs_in_a_group(args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(output, f)


class _Parser(argparse.ArgumentParser):
    """Its errors are one line, without the usage block (under torchrun, every rank prints it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _unwritable(path: str) -> str | None:
    """Why the file `path` cannot be written (None if it can): checked before a run of many minutes, not after."""
    target = Path(path)
    if target.is_dir():
        return "it is a folder"
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror}"
    if not existed:
        target.unlink()
    return None


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the memory profiler's own chatter, on every step
    parser = _Parser(prog="python -m hsync.bench", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the models run")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn (under torchrun: its world); rows that need another number of "
                             "ranks (mixed-speeds-*) get their own")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per workload (plus a warm-up)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    parser.add_argument("--quick", action="store_true", help="tiny workloads: checks the suite runs, measures little")
    parser.add_argument("--only", nargs="+", metavar="PATTERN",
                        help="run the workloads whose names match one of these regular expressions, searched "
                             "anywhere in the name: 'comm-path' selects every comm-path row, '^bert-base$' one")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of the step times here")
    parser.add_argument("--markdown", help="write a results page (command, environment, table, plot) here")
    parser.add_argument("--simulate-cluster", nargs="*", type=int, metavar="RANKS",
                        help="instead of the rows: the balancer's policy on simulated clusters of mixed GPUs of these "
                             "sizes (default 8 64 256 1024), against the oracle and the equal split; no process is "
                             "spawned (hsync/bench/cluster.py)")
    args = parser.parse_args(argv)
    for flag in ("json", "plot", "markdown"):
        path = getattr(args, flag)
        if path is not None and (problem := _unwritable(path)):
            parser.error(f"--{flag} {path}: cannot write there ({problem})")
    if args.simulate_cluster is not None:
        sizes = args.simulate_cluster or [8, 64, 256, 1024]
        if any(n < 2 for n in sizes):
            parser.error(f"--simulate-cluster: every size must be at least 2 ranks, got {sizes}")
        if max(sizes) > _MAX_SIMULATED_RANKS:  # 4,096 ranks take about 20 s on one core, and time grows with size
            parser.error(f"--simulate-cluster: at most {_MAX_SIMULATED_RANKS} ranks, got {max(sizes)}")
        for flag in ("device", "world_size", "rounds", "steps", "quick", "only"):
            if getattr(args, flag) != parser.get_default(flag):
                parser.error(f"--{flag.replace('_', '-')} does not apply to --simulate-cluster, which runs no rows")
        from hsync.bench.cluster import simulate_cluster

        simulate_cluster(sizes, markdown=args.markdown, plot=args.plot, json_path=args.json)
        return
    for flag in ("world_size", "rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    most = _MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
    if args.device == "cpu" and "RANK" not in os.environ and args.world_size > most:
        parser.error(f"--world-size {args.world_size}: at most {most} CPU ranks on this machine's "
                     f"{os.cpu_count()} cores ({_MAX_RANKS_PER_CORE} a core); more would time the scheduler")
    if args.rounds * args.steps < 2:  # a median and a p90 of one step say nothing, and quantiles refuse it
        parser.error(f"--rounds x --steps must give at least 2 timed steps per variant, got {args.rounds} x "
                     f"{args.steps}")
    if args.device == "cuda" and torch.cuda.device_count() == 0:
        parser.error("--device cuda: no CUDA device is visible here")
    for pattern in args.only or []:
        try:
            re.compile(pattern)
        except re.error as e:
            parser.error(f"--only {pattern!r} is not a regular expression: {e}")
    planned = plan_jobs(args, torch.device(args.device))
    if not planned:
        parser.error(f"--only {' '.join(args.only)} matches no workload")
    if "RANK" in os.environ:
        args.world_size = int(os.environ["WORLD_SIZE"])
        output = run_jobs_in_a_group(args)
        if int(os.environ["RANK"]) == 0:
            write_outputs(args, output)
        return
    import tempfile

    import torch.multiprocessing as mp

    worlds = sorted({args.world_size} | {job.world for job in planned if job.world})
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and worlds[-1] > gpus:
        wide = [f"{job.name} ({job.world})" for job in planned if (job.world or args.world_size) > gpus]
        parser.error(f"--device cuda: each rank needs a GPU of its own ({gpus} visible), but these rows "
                     f"need more ranks: {', '.join(wide)}; lower --world-size or choose rows with --only")
    output: dict = {"env": None, "results": []}
    # As torchrun does, unless set: OpenMP's threads beyond the ranks' share of the cores spin between parallel
    # regions, and on a core pinned to its rank (balancing.core_per_rank) a spinning thread slowed Trainer's and
    # Accelerate's steps 70-fold. Read when OpenMP loads: in the fork server, which the ranks of every world
    # come from, so the share of the widest world (each rank's worker sets its own torch threads).
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads or str(max(1, (os.cpu_count() or 1) // worlds[-1]))
    # Ranks forked from a server that has imported the benchmark (torch, transformers: seconds per process),
    # and nothing that a fork could break (no thread, no process group, no CUDA context).
    mp.set_forkserver_preload(["hsync.bench.run", *sorted({module for job in planned for module in job.imports})])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for world in worlds:
                # Served here, as torchrun's agent does, on a port taken as it binds: a port found free and handed
                # to rank 0 could be taken in between by any other process's connection.
                store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                path = os.path.join(tmp, f"world-{world}.json")
                mp.start_processes(worker, args=(world, store.port, args, path), nprocs=world,
                                   start_method="forkserver")
                del store
                with open(path) as f:
                    part = json.load(f)
                if world == args.world_size or output["env"] is None:
                    output["env"] = part["env"]
                output["results"] += part["results"]
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
    write_outputs(args, output)
