"""Small models, uneven data and the single-process references the distributed tests compare against."""

from __future__ import annotations

import torch
from torch import nn

TINY_BUCKET_MB = 100 / (1024 * 1024)  # about a hundred bytes: many buckets even for these models
GRAD_MODES = ("copied", "views", "views-zeroed")
"""How train_weighted keeps gradients: copied back from the buckets, or as bucket views
(gradient_as_bucket_view) with zero_grad(set_to_none=True), so every backward's fresh gradient is
packed by copy, or with zero_grad(set_to_none=False), so autograd accumulates into the buckets."""


COMPILE_BACKEND = "aot_eager"
"""torch.compile's backend in the distributed tests: dynamo and AOTAutograd, all that a wrapper meets (its graph
breaks, the graphs split at buckets, recompiles, backward hooks around compiled nodes), without inductor's C++ code
generation (about half a minute of CPU per test on a machine with a cold compile cache, as CI's is). Inductor
compiles the BERT program's --compile run and the benchmark's compiled rows, as their users run them."""


class Net(nn.Module):
    """An MLP with a branch that only some ranks use and a parameter nobody uses."""

    def __init__(self, dtype: torch.dtype = torch.float64, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width, dtype=dtype)
        self.hidden = nn.Linear(width, width, dtype=dtype)
        self.branch = nn.Linear(width, width, dtype=dtype)
        self.never_used = nn.Linear(width, width, dtype=dtype)
        self.out = nn.Linear(width, 1, dtype=dtype)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h).squeeze(-1)


class Stack(nn.Module):
    """Square layers of 1 MiB each: a bucket cap of 2 MiB splits a compiled graph of four into three."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(layers))  # 1 MiB each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def compiled_backward_nodes(loss: torch.Tensor) -> int:
    """How many compiled graphs' backwards the loss's graph goes through: one per piece of a split graph."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [child for child, _ in node.next_functions]
    return sum("CompiledFunctionBackward" in type(node).__name__ for node in seen)


def make_net(seed: int, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def global_batch(step: int, sizes: list[int], micro: int = 0, dtype: torch.dtype = torch.float64):
    """The global batch of one (micro-)step and its split into per-rank slices of the given sizes."""
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    x = torch.randn(sum(sizes), 4, generator=g, dtype=dtype)
    y = torch.randn(sum(sizes), generator=g, dtype=dtype)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return x, y, [(x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).mean()


def reference_training(steps: list[list[list[int]]], branch_ranks=frozenset(), lr: float = 0.1):
    """One process on the concatenated global batch: what every rank's parameters must equal.

    steps[s][k][r] is rank r's number of examples in micro-step k of step s. Rank r's examples go
    through the branch if r is in branch_ranks, and the loss is the mean over every example of
    every micro-step and rank. Returns final parameters, last gradients and per-step losses."""
    net = make_net(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step, micro_steps in enumerate(steps):
        total = sum(sum(sizes) for sizes in micro_steps)
        loss = 0
        for micro, sizes in enumerate(micro_steps):
            _, _, slices = global_batch(step, sizes, micro)
            for rank, (x, y) in enumerate(slices):
                if sizes[rank] > 0:
                    loss = loss + sizes[rank] * mse(net(x, rank in branch_ranks), y)
        loss = loss / total
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    params = {name: p.detach().clone() for name, p in net.named_parameters()}
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in net.named_parameters()}
    return params, grads, losses


def train_weighted(rank: int, world_size: int, steps, branch_ranks=frozenset(), bucket_mb=TINY_BUCKET_MB,
                   device: str = "cpu", grads: str = "copied", compiled: str | None = None):
    """The same training through WeightedDDP on this rank's slices (no_sync for all but the last micro-step).

    A rank with no examples in a micro-step runs a dummy batch with weight 0, as a trainer does
    when its data runs out. `grads` is one of GRAD_MODES. `compiled`: "module" wraps
    torch.compile(net), as nanoGPT does with DDP; "wrapper" compiles the wrapped model."""
    import contextlib

    import hsync

    net = make_net(seed=rank).to(device)
    module = torch.compile(net, backend=COMPILE_BACKEND) if compiled == "module" else net
    model = hsync.WeightedDDP(module, bucket_cap_mb=bucket_mb, first_bucket_cap_mb=bucket_mb,
                              gradient_as_bucket_view=grads != "copied")
    if compiled == "wrapper":
        model = torch.compile(model, backend=COMPILE_BACKEND)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stats = []
    for step, micro_steps in enumerate(steps):
        for micro, sizes in enumerate(micro_steps):
            x_all, y_all, slices = global_batch(step, sizes, micro)
            x, y = slices[rank] if sizes[rank] > 0 else (x_all[:1], y_all[:1])
            x, y = x.to(device), y.to(device)
            last = micro == len(micro_steps) - 1
            # On odd steps a host tensor, as a loop that counts its examples in one may pass: on a GPU it is copied
            # there without waiting for the device's queue.
            weight = sizes[rank] if step % 2 == 0 else torch.tensor(sizes[rank])
            with contextlib.nullcontext() if last else model.no_sync():
                out = model.backward(mse(model(x, rank in branch_ranks), y), weight=weight)
        stats.append((out.loss, out.weight, out.finite))
        last_grads = {name: None if p.grad is None else p.grad.detach().cpu().clone()
                      for name, p in net.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=grads != "views-zeroed")
    params = {name: p.detach().cpu() for name, p in net.named_parameters()}
    return params, last_grads, stats, model.bucket_params
