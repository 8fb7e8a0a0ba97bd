"""A DataLoader whose one item is a whole optimizer step: this rank's micro-batches of it, as an hsync.Balancer
splits the step, each collated in the DataLoader's workers. For frameworks that count one item as one step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

import hsync


class MicroBatches(list):
    """One optimizer step's micro-batches on this rank, each as the collate function made it."""


class _StepSampler(Sampler):
    """The Balancer's micro-batches grouped by step: one list of index lists per optimizer step."""

    def __init__(self, balancer: hsync.Balancer) -> None:
        self.balancer = balancer

    @property
    def sampler(self) -> hsync.Balancer:
        """Where Lightning looks for the set_epoch of a batch sampler's sampler, at each epoch's start: the
        Balancer's. (An epoch cut short, limit_train_batches, then starts the next epoch's order, as with DDP.)"""
        return self.balancer

    def __len__(self) -> int:
        return self.balancer.steps_per_epoch

    def __iter__(self) -> Iterator[list[list[int]]]:
        return self.balancer.steps()


class _Collated(Dataset):
    """Reads a micro-batch (a list of indices) as one item, collated: the DataLoader's workers collate."""

    def __init__(self, dataset: Dataset, collate: Any) -> None:
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> Any:
        return self.collate([self.dataset[i] for i in indices])


class StepLoader(DataLoader):
    """One item per optimizer step: MicroBatches, this rank's share of the step as the Balancer cuts it."""

    def __init__(self, dataset: Dataset, balancer: hsync.Balancer, collate: Any, **kwargs: Any) -> None:
        super().__init__(_Collated(dataset, collate), batch_sampler=_StepSampler(balancer), collate_fn=MicroBatches,
                         **kwargs)
        self.balancer = balancer

    def set_epoch(self, epoch: int) -> None:
        """Called by transformers' Trainer at each epoch's start (Lightning calls the batch sampler's sampler's):
        the Balancer's order of examples is the epoch's."""
        self.balancer.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where the data stands (the Balancer's state): a loader with these two methods is one Lightning saves
        in its checkpoints and restores on a resume."""
        return self.balancer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.balancer.load_state_dict(state)
