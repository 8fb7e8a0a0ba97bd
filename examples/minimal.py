"""The smallest WeightedDDP program: ranks with different batch sizes train one regression model.

    torchrun --nproc_per_node 2 examples/minimal.py                # a GPU per rank (NCCL), else CPU (gloo)
    torchrun --nproc_per_node 2 examples/minimal.py --device cpu   # CPU (gloo)
    python examples/minimal.py                                     # one process

Rank r takes 4 * (r + 1) examples a step, as a faster GPU would; the gradient is still exactly
the one of the mean loss over every example of every rank.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

import hsync
from apps.cli import Parser, at_least, device_flag


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--steps", type=at_least(1), default=50, help="optimizer steps")
    parser.add_argument("--device", type=device_flag, default="auto",
                        help="cpu (gloo), cuda (one GPU per rank, NCCL) or auto (cuda when available)")
    args = parser.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:  # torchrun's ranks: it set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        dist.init_process_group("nccl" if use_cuda else "gloo")
    else:  # plain python: a world of one
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank()

    torch.manual_seed(0)
    true_w = torch.randn(16, 1, device=device)
    model = hsync.WeightedDDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator(device=device).manual_seed(1 + rank)

    batch = 4 * (rank + 1)
    for step in range(args.steps):
        x = torch.randn(batch, 16, device=device, generator=generator)
        y = x @ true_w + 0.01 * torch.randn(batch, 1, device=device, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        stats = model.backward(loss, weight=batch)
        if stats.finite:
            optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  global loss {stats.loss:.4f}  examples {stats.weight:.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
