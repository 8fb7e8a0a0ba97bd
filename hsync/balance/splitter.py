"""Which examples each optimizer step takes, and how they are cut among ranks and into micro-batches.

Pure (no model, no clock, no collective): given the same examples, settings and cost models, every
rank computes the same steps (Note [Balancer] in balancer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from hsync.balance.planner import RankCost, longest_first, micro_batches, split_proportionally, split_step


@dataclass
class MicroBatch:
    """One of this rank's micro-batches of a step."""

    indices: list[int]
    """Dataset indices."""
    step: int
    """The global step it belongs to."""
    last: bool
    """Whether it is this rank's last of the step: its backward synchronises."""
    examples: int
    """Its examples (0 for a filler)."""
    units: float
    """Its padded units of work: examples times the longest one's cost."""
    filler: bool
    """A rank without an example in this step runs another rank's with weight 0, so that it takes part."""


@dataclass(frozen=True)
class SplitStep:
    """One step as split: every rank's share, and this rank's micro-batches."""

    sizes: list[int]
    """Each rank's examples."""
    costs: list[float]
    """The step's example costs, in the epoch's order."""
    micro_batches: list[MicroBatch]
    """This rank's micro-batches, in the order to run them."""


class StepSplitter:
    """Steps of `global_batch_size` examples of an epoch's (shuffled) order, split among `world_size` ranks by
    their cost models, or by the fixed `rank_batch_sizes`."""

    def __init__(self, costs: Sequence[float], global_batch_size: int, world_size: int, *, seed: int, shuffle: bool,
                 rank_batch_sizes: Sequence[int] | None, drop_last: bool = False) -> None:
        self.costs = list(costs)
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.rank_batch_sizes = None if rank_batch_sizes is None else list(rank_batch_sizes)

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return len(self.costs) // self.global_batch_size
        return -(-len(self.costs) // self.global_batch_size)

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of the dataset's indices, the same on every rank: a permutation drawn from (seed, epoch),
        or the dataset's own order without shuffle."""
        if not self.shuffle:
            return list(range(len(self.costs)))
        g = torch.Generator().manual_seed(self.seed + epoch)  # torch's DistributedSampler's: DDP's global batches
        return torch.randperm(len(self.costs), generator=g).tolist()

    def steps(self, epoch: int, first_step: int, base: int, rank: int,
              models_for: Callable[[int], list[RankCost]], lockstep: bool) -> Iterator[SplitStep]:
        """The steps of `epoch` from its step `first_step` on (global index `base` + its index in the epoch), each
        split by the cost models `models_for(global_step)` gives. `lockstep`: every rank must run as many
        micro-batches, none a filler (check_lockstep)."""
        order = self.order(epoch)
        batch = self.global_batch_size
        for s in range(first_step, self.steps_per_epoch):
            step = base + s
            positions = order[s * batch:(s + 1) * batch]
            costs = [self.costs[i] for i in positions]
            ranks = models_for(step)
            shares = self.split(costs, ranks)
            if lockstep:
                check_lockstep(step, [[costs[p] for p in share] for share in shares], ranks)
            yield SplitStep([len(share) for share in shares], costs,
                            self._micro_batches(step, [positions[p] for p in shares[rank]], positions[0],
                                                ranks[rank].micro_cap))

    def _micro_batches(self, step: int, mine: list[int], any_index: int, cap: float) -> list[MicroBatch]:
        ranges = micro_batches([self.costs[i] for i in mine], cap)
        if not ranges:
            return [MicroBatch([any_index], step, True, 0, self.costs[any_index], True)]
        batches = [mine[a:b] for a, b in ranges]
        return [MicroBatch(indices, step, j == len(batches) - 1, len(indices),
                           len(indices) * max(self.costs[i] for i in indices), False)
                for j, indices in enumerate(batches)]

    def split(self, costs: list[float], ranks: list[RankCost]) -> list[list[int]]:
        """Each rank's positions among one step's `costs`."""
        if self.rank_batch_sizes is None:
            return split_step(costs, ranks)
        sizes = split_proportionally(len(costs), self.rank_batch_sizes)
        bounds = [sum(sizes[:r]) for r in range(self.world_size + 1)]
        # Runs of the step's shuffled order, so that a share's tokens follow its examples; each ordered
        # longest first, as micro_batches() cuts them by the longest of each.
        return [[bounds[r] + p for p in longest_first(costs[bounds[r]:bounds[r + 1]])]
                for r in range(self.world_size)]

    def check_epoch_end_lockstep(self) -> None:
        """No step of an epoch, its last included, leaves a rank without an example (check_lockstep): found
        before training, not at the epoch's end."""
        batch = self.global_batch_size
        last = len(self.costs) - (self.steps_per_epoch - 1) * batch if self.steps_per_epoch else batch
        fixed = self.rank_batch_sizes
        for size in (batch, last):
            if size < self.world_size or (fixed is not None and 0 in split_proportionally(size, fixed)):
                raise ValueError(
                    f"hsync.Balancer: a step of size {size} would leave a rank without an example, but the model's "
                    "backward passes exchange gradients between ranks (WeightedDDP.cross_rank_backward, a "
                    "SyncBatchNorm), so every rank must run every step; choose a global_batch_size whose "
                    f"remainder in the {len(self.costs)} examples, if any, gives each rank one")


def check_lockstep(step: int, share_costs: list[list[float]], ranks: list[RankCost]) -> None:
    """With cross_rank_backward (a SyncBatchNorm) every forward is a collective, so every rank must run
    the same number of micro-batches, none of them a filler, whose example would enter the others'
    statistics. Raised on every rank alike (the plan is the same everywhere), before the step runs."""
    counts = [len(micro_batches(costs, rank.micro_cap)) for costs, rank in zip(share_costs, ranks, strict=True)]
    if min(counts) == 0 or len(set(counts)) > 1:
        raise RuntimeError(
            f"hsync.Balancer: step {step} would give the ranks {counts} micro-batches, but the model's "
            "backward passes exchange gradients between ranks (WeightedDDP.cross_rank_backward, a "
            "SyncBatchNorm), so every rank must run the same number of forwards, with one example at "
            "least; plan one micro-batch per rank and step (no micro_batch_limit)")
