"""Exact global metrics for a training loop's own evaluation: each rank evaluates its shard of the data
once (no example padded in or counted twice), and only the sums are collective.

    sampler = hsync.ShardSampler(len(test_set), batch_size=64)
    correct = count = 0
    for batch in DataLoader(test_set, batch_sampler=sampler):
        correct += (model(batch.x).argmax(-1) == batch.y).sum()
        count += len(batch.y)
    totals = hsync.sum_over_ranks({"correct": correct, "count": count})
    accuracy = totals["correct"] / totals["count"]   # the same number on every rank

torch's DistributedSampler pads the last shard with repeated examples so that every rank runs the
same number of batches, which is why gathered metrics need de-duplicating afterwards. Here ranks may
run different numbers of batches: nothing but the final sums is collective.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from hsync.collectives import Channels
from hsync.errors import describe


class ShardSampler(Sampler[list[int]]):
    """A batch sampler over this rank's contiguous share of `num_examples`: every example on exactly one
    rank, in order, in batches of at most `batch_size` (a rank may get none when there are fewer
    examples than ranks)."""

    def __init__(self, num_examples: int, batch_size: int, group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(num_examples, int) or num_examples < 0:
            raise ValueError(f"hsync.ShardSampler: num_examples must be a non-negative integer, got {num_examples!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"hsync.ShardSampler: batch_size must be a positive integer, got {batch_size!r}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.start, self.stop = num_examples * rank // world, num_examples * (rank + 1) // world
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.start, self.stop, self.batch_size):
            yield list(range(first, min(first + self.batch_size, self.stop)))

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.batch_size)


def sum_over_ranks(values: Mapping[str, float | torch.Tensor],
                   group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Each value summed over every rank of `group` in float64 (counts stay exact up to 2**53). Every rank
    must pass the same names in the same order, each with one number; otherwise every rank raises. Under
    hsync's collective deadline (HSYNC_TIMEOUT): a peer that froze or died is an error naming it."""
    mapping = isinstance(values, Mapping)
    names = list(values) if mapping else []
    slots: list[torch.Tensor] = []
    problem = None if mapping else f"it passed {describe(values)}, not a mapping of names to numbers"
    for name in names:
        try:
            slot = torch.as_tensor(values[name], dtype=torch.float64).detach().cpu()
        except (TypeError, ValueError, RuntimeError):
            problem = f"'{name}' is a {type(values[name]).__name__}"
            break
        if slot.numel() != 1:
            problem = f"'{name}' has shape {tuple(slot.shape)}"
            break
        slots.append(slot.reshape(()))
    channel = Channels.of_group(group)
    # Agreement first, in a small collective of its own, so that ranks naming different numbers of metrics
    # never meet in a reduction of different sizes.
    checksum = float(zlib.crc32("\0".join(names).encode()))
    header = torch.tensor([len(names), checksum, 1.0 if problem else 0.0], dtype=torch.float64)
    headers = channel.gather(header, "hsync.sum_over_ranks's names")
    refused = [r for r in range(channel.world_size) if headers[r, 2] > 0]
    if refused:
        culprit = refused[-1]  # its own message says what it passed
        raise (ValueError if mapping else TypeError)(
            f"hsync.sum_over_ranks: rank {culprit} passed a value that is not one number"
            + (f": {problem}" if culprit == channel.rank else ""))
    if not bool((headers[:, :2] == headers[0, :2]).all()):
        raise ValueError(f"hsync.sum_over_ranks: ranks passed different metric names (this rank: {names})")
    if not names:
        return {}
    totals = channel.all_reduce_sum(torch.stack(slots), "hsync.sum_over_ranks's sums")
    return dict(zip(names, totals.tolist(), strict=True))
