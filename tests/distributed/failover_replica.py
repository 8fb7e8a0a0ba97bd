"""One replica group of a fault-tolerant run, for tests/distributed/test_failover.py: a small net on fixed data,
trained by hsync.fault_tolerance.FaultTolerantSteps, its learning rate on a schedule. It logs each step it commits
(its examples, the quorum's size) and writes its parameters at the end; with --kill STEP:WHERE it kills itself
(SIGKILL) at that point of the first step it runs once STEP steps have committed; with --stop-at STEP it writes the
job's checkpoint once STEP steps have committed and ends, and --resume starts from that checkpoint.

    python tests/distributed/failover_replica.py --lighthouse URL --replica-id g0 --out DIR [--kill 7:backward]
        [--buckets one] [--stop-at 10 | --resume] [--global-batch 24]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

EXAMPLES, GLOBAL_BATCH, EPOCHS, LR = 96, 12, 3, 0.1
KILL_POINTS = ("forward", "backward", "reduction", "optimizer")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(EXAMPLES, 8, generator=g), torch.randn(EXAMPLES, 2, generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def make_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning rate that falls with each committed step: a replica that joins must take the count."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill", default=None, help="STEP:WHERE, WHERE one of " + ", ".join(KILL_POINTS))
    parser.add_argument("--wait-for", type=int, default=0,
                        help="before the first step, wait until this many replicas are up (heartbeating): with "
                             "min_replicas 1, replicas that start apart could otherwise each begin a job of their own")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU check's)")
    parser.add_argument("--buckets", choices=("one", "many"), default="many",
                        help="one bucket for the model, or one per parameter (a kill in the reduction leaves some "
                             "sent, some not)")
    parser.add_argument("--wait-at", type=int, default=0, help="the step before which --wait-for applies")
    parser.add_argument("--stop-at", type=int, default=None, help="write the job's checkpoint after this step, end")
    parser.add_argument("--resume", action="store_true", help="start from the job's checkpoint in --out")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import hsync
    from hsync.fault_tolerance import FaultToleranceConfig, FaultTolerantSteps

    device = torch.device(args.device)
    x, y = (t.to(device) for t in data())
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    schedule = make_schedule(optimizer)
    config = FaultToleranceConfig(lighthouse=args.lighthouse, replica_id=args.replica_id, host="localhost",
                                  timeout=datetime.timedelta(seconds=20),
                                  quorum_timeout=datetime.timedelta(seconds=60))
    buckets = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4} if args.buckets == "many" else {}
    steps = FaultTolerantSteps(model, optimizer, EXAMPLES, hsync.BalanceConfig(global_batch_size=args.global_batch),
                               config, wrap_options=buckets, state={"schedule": schedule})
    checkpoint = args.out / f"{args.replica_id}.ckpt"
    if args.resume:
        steps.load_state_dict(torch.load(checkpoint, weights_only=True))
    log = (args.out / f"{args.replica_id}.jsonl").open("a")
    (args.out / f"{args.replica_id}.up").touch()

    def wait_for_replicas() -> None:
        deadline = time.monotonic() + 60
        while len(list(args.out.glob("*.up"))) < args.wait_for and time.monotonic() < deadline:
            time.sleep(0.05)

    def record(step: int) -> None:
        log.write(json.dumps({"step": step, "examples": steps.examples_in_step, "replicas": steps.model.world_size,
                              "pid": os.getpid(), "lr": optimizer.param_groups[0]["lr"]}) + "\n")
        log.flush()

    if args.kill:
        kill_step, where = args.kill.split(":")

        def kill(*_: object) -> None:
            # The step being run: in the optimizer's step, it has committed already (and is logged: this
            # replica's share is in its update). At or after: a replica that joined late starts at the job's step.
            running = steps.global_step - 1 if where == "optimizer" else steps.global_step
            if running >= int(kill_step):
                os.kill(os.getpid(), signal.SIGKILL)

        if where == "forward":
            model.register_forward_pre_hook(kill)
        elif where == "backward":  # the output layer's gradient: the first of backward, before any reduction
            model[-1].weight.register_hook(kill)
        elif where == "reduction":  # the first layer's: the last, after the other buckets went out
            model[0].weight.register_hook(kill)
        else:
            optimizer.register_step_pre_hook(kill)

    def loss_of(indices: list[int]) -> torch.Tensor:
        return nn.functional.mse_loss(steps.model(x[indices]), y[indices])

    with steps:
        for epoch in range(steps.epoch, EPOCHS):
            steps.set_epoch(epoch)
            while True:
                if steps.global_step == args.wait_at:
                    wait_for_replicas()
                if (stats := steps.step(loss_of)) is None:
                    break
                record(steps.global_step - 1)
                if stats.finite:
                    optimizer.step()
                    schedule.step()
                if steps.global_step == args.stop_at:
                    torch.save(steps.state_dict(), checkpoint)
                    return
        on_cpu = {name: value.cpu() for name, value in model.state_dict().items()}
        torch.save(on_cpu, args.out / f"{args.replica_id}.pt")


if __name__ == "__main__":
    main()
