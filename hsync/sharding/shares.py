"""Which rank owns which parameters' optimizer state: contiguous ranges sized by what each rank can hold.

Note [Memory shares]
A rank's budget is the memory it can give to the model's state: its parameters, their gradients and
the optimizer state it owns. Parameters are whole on every rank; the gradients a rank keeps are those
of the parameters it owns (another rank's bucket is let go once sent: Note [Owned buckets] in
csrc/engine.cpp), plus what a backward holds in flight: the two buffers other ranks' buckets take turns
in, and a fresh gradient. So each rank's capacity is its budget less the parameters, what is in flight
and the gradients of the parameters outside the optimizer's groups (whole on every rank, for an
optimizer of the user's), and the parameters are split, in registration order, into one contiguous
range per rank whose gradients and optimizer state are in proportion to that capacity. A group added
later keeps what is owned already where it is (its state is there) and is split the same way, in proportion
to what each rank lacks of its share once the group counts; so a rank owns one range and a contiguous part of
each added group. A rank that
declares nothing shares in proportion to the device memory it can still get, measured after the model
was placed (the parameters counted back in), as the Balancer measures it for its micro-batches
(obtainable_bytes: the card's free memory and the allocator's cache, or a per-process fraction's cap);
so the Balancer then plans micro-batches from what the state leaves. On the CPU, where there is no such
measure, ranks that declare nothing get equal shares. A model whose state cannot fit is refused before
any step, naming each rank, its budget and what it would need.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from hsync.balance.memory import obtainable_bytes
from hsync.errors import describe

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

MemoryBudget = int | float | str | Sequence[int | float | str] | None


def parse_bytes(value: int | float | str, what: str = "memory_budget") -> int:
    """A size in bytes: a number of bytes, or a string such as "6GiB", "512 MB", "1.5e9"."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{what} must be a number of bytes or a size such as '6GiB', got {describe(value)}")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if not match or match.group(2) not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r} as a size (for example '6GiB', '512MB' or 1e9)")
        number = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        number = float(value)
    if not (1 <= number < float("inf")):  # a fraction of a byte would be a budget of 0
        raise ValueError(f"{what} must be a positive, finite size of at least one byte, got {value!r}")
    return int(number)


def this_ranks_budget(memory_budget: MemoryBudget, rank: int, world_size: int, device: torch.device,
                      held_bytes: int) -> int | None:
    """This rank's budget in bytes (Note [Memory shares]); None: undeclared on a CPU (an equal share).
    `held_bytes`: what the model's state takes on the device already (counted back into a measured budget)."""
    if isinstance(memory_budget, list | tuple):
        if len(memory_budget) != world_size:
            raise ValueError(f"memory_budget lists {len(memory_budget)} budget(s) for {world_size} ranks: give one "
                             "per rank, in rank order, or one size for this rank")
        return parse_bytes(memory_budget[rank], f"memory_budget[{rank}]")
    if memory_budget is not None:
        return parse_bytes(memory_budget)
    if device.type == "cuda":  # what this process can still allocate, and the parameters it holds already
        return max(0, obtainable_bytes(device) - torch.cuda.memory_allocated(device)) + held_bytes
    return None


@dataclass(frozen=True)
class Layout:
    """Where the optimizer state lives: rank r owns parameters owned[r] (indices in registration order)."""

    owned: tuple[tuple[int, ...], ...]
    """Per rank, the parameters it owns: one contiguous range as first planned, and a contiguous part of each
    group added since (Note [Memory shares])."""
    needs: tuple[int, ...]
    """Per rank, the bytes of parameters, gradients in flight and its gradients and optimizer state under
    this layout."""


def plan_layout(sizes: Sequence[int], budgets: Sequence[int | None], owned_per_byte: float,
                in_flight: int = 0, outside: Collection[int] = (), outside_per_byte: float = 0.0,
                kept: Sequence[Collection[int]] | None = None) -> Layout:
    """Splits parameters of `sizes` bytes into contiguous ranges, one per rank, what each rank keeps for the
    parameters it owns (`owned_per_byte` bytes per byte of parameter: their gradients and optimizer state) in
    proportion to its capacity: its budget less the parameters, the `in_flight` bytes a backward holds at once
    and the gradients (`outside_per_byte` per byte) of the parameters `outside` the optimizer's groups (indices
    into `sizes`), which every rank keeps whole. Those cost their range nothing. `kept`: per rank, parameters it
    owns already and keeps (their state exists there); the others are split among the ranks in proportion to
    what each lacks of its proportional share. Refuses a model whose state cannot fit (ValueError naming every
    rank)."""
    world = len(budgets)
    total = sum(sizes)
    shard = [0 if i in outside else size for i, size in enumerate(sizes)]  # what a range is sized by
    shard_total = sum(shard)
    outside_gradients = int((total - shard_total) * outside_per_byte)
    whole = total + in_flight + outside_gradients  # on every rank
    if all(b is None for b in budgets):
        capacities = [1.0] * world
    elif any(b is None for b in budgets):
        raise ValueError("memory_budget: declare a budget on every rank or on none")
    else:
        capacities = [max(0.0, b - whole) for b in budgets]
    sharded = shard_total * owned_per_byte
    fixed = Fixed(total, in_flight, outside_gradients)
    if budgets[0] is not None and (sum(capacities) < sharded or sum(capacities) == 0):
        raise ValueError(refusal(budgets, fixed, sharded))
    kept = [sorted(k) for k in kept] if kept is not None else [[] for _ in range(world)]
    held = [sum(shard[i] for i in k) for k in kept]
    lacking = [max(0.0, shard_total * c / sum(capacities) - h) for c, h in zip(capacities, held, strict=True)]
    placed = {i for k in kept for i in k}
    runs = _contiguous_runs([i for i in range(len(sizes)) if i not in placed], shard,
                            lacking if sum(lacking) > 0 else capacities)
    owned = tuple(tuple(sorted(k + run)) for k, run in zip(kept, runs, strict=True))
    needs = tuple(whole + int(sum(shard[i] for i in r) * owned_per_byte) for r in owned)
    if budgets[0] is not None and any(need > budget for need, budget in zip(needs, budgets, strict=True)):
        raise ValueError(refusal(budgets, fixed, sharded, needs))
    return Layout(owned, needs)


def _contiguous_runs(indices: list[int], shard: Sequence[int], weights: Sequence[float]) -> list[list[int]]:
    """`indices`, in order, cut into one run per rank whose bytes (`shard`) follow `weights`; each cut at the
    tensor boundary nearest its target (a tensor is whole), the last rank taking the rest."""
    total = sum(shard[i] for i in indices)
    runs, start, prefix, cumulative = [], 0, 0, 0.0
    for rank, weight in enumerate(weights):
        cumulative += weight
        end = start
        while end < len(indices) and (rank == len(weights) - 1
                                      or prefix + shard[indices[end]] / 2 <= total * cumulative / sum(weights)):
            prefix += shard[indices[end]]
            end += 1
        runs.append(indices[start:end])
        start = end
    return runs


@dataclass(frozen=True)
class Fixed:
    """What every rank holds whatever it owns, in bytes."""

    parameters: int
    in_flight: int
    outside_gradients: int


def refusal(budgets: Sequence[int | None], fixed: Fixed, sharded: float, needs: Sequence[int] | None = None) -> str:
    ranks = ", ".join(f"rank {r}: budget {_mib(b)}" + (f", needs {_mib(needs[r])}" if needs else "")
                      for r, b in enumerate(budgets))
    outside = (f", the gradients of the parameters outside the optimizer's groups ({_mib(fixed.outside_gradients)})"
               if fixed.outside_gradients else "")
    return (f"hsync.ShardedOptimizer: the model's state does not fit the ranks' memory budgets ({ranks}); every "
            f"rank holds the parameters whole ({_mib(fixed.parameters)}), the gradient buckets in flight "
            f"({_mib(fixed.in_flight)}){outside} and a share of the gradients and optimizer state "
            f"({_mib(int(sharded))} in all). Raise the budgets, add ranks or shrink the model")


def _mib(size: int | None) -> str:
    if size is None:
        return "undeclared"
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
