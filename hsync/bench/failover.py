"""The `failover` row: what a lost replica costs. Three replica groups (one CPU process each) train the same model
on the same data for the same number of steps while a group is killed (SIGKILL, in its backward) every K steps
and started again at once, through:

- hsync on torchft (hsync.fault_tolerance.FaultTolerantSteps): the survivors redo the step on the same examples;
- torchft's own DDP (torchft.ddp.DistributedDataParallel and OptimizerWrapper, each group its local batch of the
  step): the failed step is dropped and the next ones commit the survivors' examples only;
- torchrun restarting every worker from the last checkpoint (hsync.WeightedDDP, a checkpoint every C steps, as
  the other two write too): the steps since are done again.

Goodput is the examples of committed steps over the time from the first committed step to the last (start-up
left out, restarts in), the checkpoint run counting each step once. Each group logs its committed steps; the row
counts the examples lost and repeated per epoch, compares hsync's parameters with one process making the same
steps, and times each recovery from the kill to the survivors' next committed step.

    python -m hsync.bench --only '^failover$'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hsync.bench.result import NAN, Result

GROUPS = 3
GLOBAL_BATCH = 96
EXAMPLES = 960  # ten steps an epoch
WIDTH = 1024  # a step of tens of milliseconds on a CPU core: a restarted group is back within tens of steps
LR = 0.05
JOB_LIMIT_S = 300
STRAGGLER_S = 3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(EXAMPLES, 64, generator=g)
    return x, torch.tanh(x @ torch.randn(64, 8, generator=g))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 8))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def epoch_order(epoch: int) -> list[int]:
    return torch.randperm(EXAMPLES, generator=torch.Generator().manual_seed(1 + epoch)).tolist()


# -- the row (on rank 0 of a world of one: it starts the jobs) -------------------------------------------------

def failover(quick: bool) -> Result:
    """The row: each job run once, in turn (hsync's without failures too: the floor of the table)."""
    steps = 20 if quick else 90
    every, checkpoint_every = steps // 3, 5
    # Step: the group killed in it. Two and three steps after a checkpoint: on average half an interval is lost.
    # Quick: one kill, each of its recoveries being seconds of processes started anew.
    kills = {every + 2: 1} if quick else {every + 2: 1, 2 * every + 3: 2}
    with tempfile.TemporaryDirectory() as root:
        runs = {name: Path(root, name) for name in ("clean", "hsync", "torchft", "checkpoint")}
        for name, path in runs.items():
            path.mkdir()
            if name == "checkpoint":
                _run_torchrun_job(path, steps, kills, checkpoint_every)
            else:
                _run_torchft_job(path, "torchft" if name == "torchft" else "hsync", steps,
                                 {} if name == "clean" else kills, checkpoint_every)
        logs = {name: _committed(path) for name, path in runs.items()}
        kills_seen = {name: _kills(path) for name, path in runs.items()}
        trained = torch.load(runs["hsync"] / "g0.pt")
    seconds = {name: _span(log) for name, log in logs.items()}
    examples = {name: sum(len(r["examples"]) for records in log.values() for r in records) for name, log in logs.items()
                if name != "checkpoint"}
    examples["checkpoint"] = steps * GLOBAL_BATCH  # every step's, once, however often it was done
    goodput = {name: examples[name] / seconds[name] for name in runs}
    lost, repeated = _lost_and_repeated(logs["hsync"], steps)
    ddp_lost, _ = _lost_and_repeated(logs["torchft"], steps)
    reference = _uninterrupted(logs["hsync"])
    diff = max((trained[k] - v).abs().max().item() for k, v in reference.items())
    extra = {"examples_lost": float(lost), "examples_repeated": float(repeated),
             "max_param_diff_vs_uninterrupted": diff,
             "goodput_vs_torchft_ddp": goodput["hsync"] / goodput["torchft"],
             "goodput_vs_checkpoint_restart": goodput["hsync"] / goodput["checkpoint"],
             "goodput_vs_no_failure": goodput["hsync"] / goodput["clean"],
             "seconds_to_recover": _recovery(logs["hsync"], kills_seen["hsync"]),
             "torchft_ddp_seconds_to_recover": _recovery(logs["torchft"], kills_seen["torchft"]),
             "checkpoint_restart_seconds_to_recover": _recovery(logs["checkpoint"], kills_seen["checkpoint"]),
             "torchft_ddp_examples_lost": float(ddp_lost), "failures": float(len(kills)), "steps": float(steps)}
    per_step = {name: seconds[name] / steps for name in runs}
    # The table's columns: hsync's step, torchft DDP's in "DDP", and hsync's without failures as the floor.
    return Result("failover", per_step["hsync"], per_step["torchft"], per_step["clean"], NAN, NAN, NAN, GLOBAL_BATCH,
                  extra=extra | {"checkpoint_restart_step_s": per_step["checkpoint"]})


def _run_torchft_job(out: Path, variant: str, steps: int, kills: dict[int, int], checkpoint_every: int) -> None:
    from hsync.fault_tolerance import lighthouse_command  # torchft: only where this row runs

    port = _free_port()
    # Two groups at least, so that a group restarted as the job ends waits (and is stopped) instead of starting
    # the job anew on its own; the kills never leave fewer than two for long (they wait for the restart).
    lighthouse = subprocess.Popen(lighthouse_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    victims = {group: step for step, group in kills.items()}

    def start(group: int, kill: int | None) -> subprocess.Popen:
        command = [sys.executable, "-m", "hsync.bench.failover", "replica", "--variant", variant, "--group",
                   str(group), "--lighthouse", f"http://localhost:{port}", "--steps", str(steps), "--out", str(out),
                   "--checkpoint-every", str(checkpoint_every)] + (["--kill-at", str(kill)] if kill else [])
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=(out / f"g{group}.err").open("a"),
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    deadline, done_at = time.monotonic() + JOB_LIMIT_S, None
    running: dict[int, subprocess.Popen] = {}
    try:
        running.update({g: start(g, victims.get(g)) for g in range(GROUPS)})
        restarted = set()
        while running:
            if done_at is not None and time.monotonic() > done_at + STRAGGLER_S:
                break  # a restarted group that came back after the end waits for a quorum that never comes
            if time.monotonic() > deadline:
                tails = {g: (out / f"g{g}.err").read_text()[-800:] for g in running}
                raise RuntimeError(f"failover row: {variant} groups {sorted(running)} still running after "
                                   f"{JOB_LIMIT_S} s: {tails}")
            for group, process in list(running.items()):
                if process.poll() is None:
                    continue
                del running[group]
                if process.returncode == 0 and done_at is None:
                    done_at = time.monotonic()
                if process.returncode == -signal.SIGKILL and group not in restarted:
                    restarted.add(group)
                    running[group] = start(group, None)  # at once, as torchrun --max-restarts would
                elif process.returncode != 0:
                    raise RuntimeError(f"failover row: {variant} group {group} exited with {process.returncode}: "
                                       f"{(out / f'g{group}.err').read_text()[-1500:]}")
            time.sleep(0.05)
    finally:
        for process in [*running.values(), lighthouse]:
            process.kill()
            process.wait()


def _run_torchrun_job(out: Path, steps: int, kills: dict[int, int], checkpoint_every: int) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={GROUPS}",
               f"--max-restarts={len(kills)}", "-m", "hsync.bench.failover", "worker", "--steps", str(steps),
               "--out", str(out), "--checkpoint-every", str(checkpoint_every),
               "--kills", ",".join(f"{step}:{group}" for step, group in kills.items())]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            timeout=JOB_LIMIT_S)
    if result.returncode != 0:
        raise RuntimeError(f"failover row: the torchrun job failed: {result.stderr[-1500:]}")


def _committed(out: Path) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = collections.defaultdict(list)
    for log in out.glob("*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "step" in record:
                steps[record["step"]].append(record)
    return steps


def _kills(out: Path) -> list[tuple[float, int]]:
    """When each kill was, and in which step."""
    records = [json.loads(line) for log in out.glob("*.jsonl") for line in log.read_text().splitlines()]
    return sorted((r["killed"], r["at_step"]) for r in records if "killed" in r)


def _span(log: dict[int, list[dict]]) -> float:
    """From the first committed step's end to the last's: each step's time, the first excepted, is in."""
    first, last = min(log), max(log)
    return (min(r["time"] for r in log[last]) - min(r["time"] for r in log[first])) * len(log) / max(1, len(log) - 1)


def _recovery(log: dict[int, list[dict]], kills: list[tuple[float, int]]) -> float:
    """The median time from a kill to the first commit of the step it was in (or a later one)."""
    commits = sorted((r["time"], step) for step, records in log.items() for r in records)
    waits = [next((t for t, step in commits if t > killed and step >= at_step), NAN) - killed
             for killed, at_step in kills]
    return statistics.median(waits) if waits else NAN


def _lost_and_repeated(log: dict[int, list[dict]], steps: int) -> tuple[int, int]:
    """Per epoch, the examples no committed step used, and the uses beyond the first."""
    per_epoch = EXAMPLES // GLOBAL_BATCH
    lost = repeated = 0
    for epoch in range(steps // per_epoch):
        used = collections.Counter(i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                                   for r in log.get(s, []) for i in r["examples"])
        lost += EXAMPLES - len(used)
        repeated += sum(n - 1 for n in used.values())
    return lost, repeated


def _uninterrupted(log: dict[int, list[dict]]) -> dict[str, torch.Tensor]:
    x, y = data()
    model = make_model()
    optimizer = make_optimizer(model)
    for step in sorted(log):
        examples = [i for r in log[step] for i in r["examples"]]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[examples]), y[examples]).backward()
        optimizer.step()
    return model.state_dict()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a replica group of a torchft job ----------------------------------------------------------------------

def _replica(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    x, y = data()
    model = make_model()
    optimizer = make_optimizer(model)
    log = (args.out / f"g{args.group}.jsonl").open("a")

    def record(**fields: object) -> None:
        log.write(json.dumps({"time": time.time(), **fields}) + "\n")
        log.flush()

    def kill_in_backward(step_of: Callable[[], int]) -> None:
        def hook(grad: torch.Tensor) -> None:
            if args.kill_at is not None and step_of() >= args.kill_at:
                record(killed=time.time(), at_step=step_of())
                os.kill(os.getpid(), signal.SIGKILL)
        model[0].weight.register_hook(hook)  # the last gradient of backward: after the other buckets went out

    def checkpoint(step: int) -> None:
        if args.group == 0 and step % args.checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out / "checkpoint.pt")

    if args.variant == "hsync":
        import hsync
        from hsync.fault_tolerance import FaultToleranceConfig, FaultTolerantSteps

        config = FaultToleranceConfig(lighthouse=args.lighthouse, replica_id=f"g{args.group}", host="localhost")
        steps = FaultTolerantSteps(model, optimizer, EXAMPLES, hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH,
                                                                                   seed=1), config)
        kill_in_backward(lambda: steps.global_step)
        with steps:
            while steps.global_step < args.steps:
                steps.set_epoch(steps.global_step * GLOBAL_BATCH // EXAMPLES)
                steps.step(lambda indices: nn.functional.mse_loss(steps.model(x[indices]), y[indices]))
                optimizer.step()
                record(step=steps.global_step - 1, examples=steps.examples_in_step)
                checkpoint(steps.global_step)
        torch.save(model.state_dict(), args.out / f"g{args.group}.pt")
        return

    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=lambda s: (
        model.load_state_dict(s["model"]), optimizer.load_state_dict(s["optimizer"])), state_dict=lambda: {
        "model": model.state_dict(), "optimizer": optimizer.state_dict()}, replica_id=f"g{args.group}",
        lighthouse_addr=args.lighthouse, store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        hostname="localhost")
    class SurvivingDDP(DistributedDataParallel):
        """torchft's DDP with its hook's one flaw fixed: in 0.2.0 a wait that failed (a peer lost in the all-reduce)
        leaves the future it then asserts on unset, and the survivor dies of the AssertionError. Here the bucket
        is returned as it is; the manager holds the error and the step does not commit, as torchft intends."""

        @staticmethod
        def _comm_hook(state, bucket):  # noqa: ANN001, ANN205 - DDP checks real annotations, and these are strings
            work = state.allreduce(bucket.buffer())
            if not work.wait():
                future = torch.futures.Future()
                future.set_result(bucket.buffer())
                return future
            return work.get_future()._fut

    wrapped = SurvivingDDP(manager, model)
    wrapped_optimizer = OptimizerWrapper(manager, optimizer)
    kill_in_backward(manager.current_step)
    local = GLOBAL_BATCH // GROUPS
    while manager.current_step() < args.steps:
        step = manager.current_step()
        # This group's part of the step's global batch: with a group missing, its part is not trained on.
        start = (step * GLOBAL_BATCH) % EXAMPLES + args.group * local
        indices = epoch_order(step * GLOBAL_BATCH // EXAMPLES)[start:start + local]
        wrapped_optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(x[indices]), y[indices]).backward()
        participating = manager.is_participating()  # a healing group's gradient is zeros in this step
        wrapped_optimizer.step()
        if manager.current_step() > step and participating:
            record(step=step, examples=indices)
            checkpoint(step + 1)
    manager.shutdown(wait=False)


# -- a worker of the torchrun job that restarts from checkpoints -------------------------------------------

def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import hsync

    torch.set_num_threads(1)
    # Keys of this attempt's own: the agent's store keeps the dead workers' addresses (apps/cli.py, the same).
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("gloo", store=attempt, rank=rank, world_size=world_size)
    x, y = data()
    model = hsync.WeightedDDP(make_model())
    optimizer = make_optimizer(model)
    path = args.out / "checkpoint.pt"
    step = 0
    if path.exists():
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    kills = dict(tuple(map(int, kill.split(":"))) for kill in args.kills.split(",") if kill)
    log = (args.out / f"r{rank}.jsonl").open("a")
    local = GLOBAL_BATCH // dist.get_world_size()
    while step < args.steps:
        if kills.get(step) == rank and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < len(kills) and \
                not (args.out / f"killed-{step}").exists():
            (args.out / f"killed-{step}").touch()
            log.write(json.dumps({"killed": time.time(), "at_step": step}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        start = (step * GLOBAL_BATCH) % EXAMPLES + rank * local
        indices = epoch_order(step * GLOBAL_BATCH // EXAMPLES)[start:start + local]
        model.backward(nn.functional.mse_loss(model(x[indices]), y[indices]), weight=len(indices))
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        log.write(json.dumps({"time": time.time(), "step": step - 1, "examples": indices}) + "\n")
        log.flush()
        if rank == 0 and step % args.checkpoint_every == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       args.out / "checkpoint.tmp")
            os.replace(args.out / "checkpoint.tmp", path)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a process of the failover row's jobs (python -m hsync.bench runs "
                                                 "the row)")
    parser.add_argument("role", choices=("replica", "worker"))
    parser.add_argument("--variant", choices=("hsync", "torchft"), default="hsync")
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--lighthouse")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kills", default="")
    args = parser.parse_args(argv)
    (_replica if args.role == "replica" else _worker)(args)


if __name__ == "__main__":
    main()
