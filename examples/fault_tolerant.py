"""A fault-tolerant job: each replica group trains a regression model with hsync on torchft, and a group that is
lost costs the step it died in, not the run (hsync.fault_tolerance, Note [Failover]). Three groups and a
Lighthouse on one machine, one of them killed at step 40 and restarted by its torchrun; the other two go on
without it, then take it back in (with --min-replicas 3 before the 3, every step needs all three: they wait for
it instead):

    scripts/fault_tolerant_local.sh 3 examples/fault_tolerant.py --device cpu --crash group1:40

Each group is a job of its own, started as the script starts it, or by hand on any machine:

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 2000 &       # once, anywhere: a majority of the groups
    REPLICA_GROUP_ID=group0 TORCHFT_LIGHTHOUSE=http://HOST:29510 \\
        torchrun --standalone --nproc_per_node 1 --max-restarts 3 examples/fault_tolerant.py

Every committed step is the exact weighted mean over the global batch, whichever groups ran it; every group ends
with the same parameters, and prints their digest.
"""

import hashlib
import os
import signal

import torch
from torch import nn

import hsync
from apps.cli import Parser, at_least, device_flag, is_count

MAX_EXAMPLES = 2**24


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--epochs", type=at_least(1), default=3, help="passes over the data")
    parser.add_argument("--examples", type=at_least(1), default=4096, help="examples in the data set")
    parser.add_argument("--global-batch-size", type=at_least(1), default=32, help="examples in a step, all groups")
    parser.add_argument("--device", type=device_flag, default="auto",
                        help="cpu, cuda (this group's GPU) or auto (cuda when available)")
    parser.add_argument("--crash", metavar="GROUP:STEP", default=None,
                        help="for a demonstration: replica group GROUP kills itself at step STEP, once")
    args = parser.parse_args()
    if args.examples > MAX_EXAMPLES:  # made in this process's memory, before any step
        parser.error(f"argument --examples: at most {MAX_EXAMPLES} (the data is made in memory, 68 bytes an "
                     f"example), got {args.examples}")
    crash_group, crash_step = None, None
    if args.crash is not None:
        crash_group, _, step_text = args.crash.partition(":")
        if not crash_group or not is_count(step_text):
            parser.error(f"argument --crash: expected GROUP:STEP (group1:40), got {args.crash!r}")
        crash_step = int(step_text)
        per_epoch = -(-args.examples // args.global_batch_size)  # the last step of an epoch may be short
        if crash_step >= args.epochs * per_epoch:
            parser.error(f"argument --crash: the run's steps are 0 to {args.epochs * per_epoch - 1} ({args.epochs} "
                         f"epochs of {per_epoch}), got step {crash_step}")
    replica = os.environ.get("REPLICA_GROUP_ID")
    if not replica or not os.environ.get("TORCHFT_LIGHTHOUSE"):
        parser.error("set REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE (scripts/fault_tolerant_local.sh does)")

    from hsync.fault_tolerance import FaultTolerantSteps  # torchft: hsync[torchft]

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    data = torch.Generator().manual_seed(0)
    x = torch.randn(args.examples, 16, generator=data)
    y = x @ torch.randn(16, 1, generator=data) + 0.01 * torch.randn(args.examples, 1, generator=data)
    x, y = x.to(device), y.to(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = FaultTolerantSteps(model, optimizer, args.examples,
                               hsync.BalanceConfig(global_batch_size=args.global_batch_size))
    # A restarted group (torchrun counts its restarts) does not crash again.
    crashes = replica == crash_group and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def loss_of(indices: list[int]) -> torch.Tensor:
        if crashes and steps.global_step == crash_step:
            print(f"killing myself in step {crash_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.functional.mse_loss(steps.model(x[indices]), y[indices])

    with steps:
        for epoch in range(steps.epoch, args.epochs):
            steps.set_epoch(epoch)
            while (stats := steps.step(loss_of)) is not None:
                if stats.finite:
                    optimizer.step()
                step = steps.global_step - 1
                if step % 50 == 0:
                    print(f"step {step:4d}  replicas {steps.model.world_size}  "
                          f"global loss {stats.loss:.4f}  examples {stats.weight:.0f}", flush=True)
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
        print(f"done: {steps.global_step} steps, parameters {digest.hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
