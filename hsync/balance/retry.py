"""What running a micro-batch again in parts takes: cutting a collated batch, and undoing a failed backward."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def rows_of(batch) -> int:
    """Examples in a collated batch: the first dimension of its first tensor (in a tensor, a mapping, a list
    or a tuple of them, nested)."""
    for value in _leaves(batch):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError(f"hsync.Balancer: found no tensor in the batch ({type(batch).__name__}) to cut into parts")


def halves(batch) -> tuple[object, object]:
    """The batch cut in two along the first dimension of each tensor that has its rows; anything else goes
    whole into both halves."""
    rows = rows_of(batch)
    return _take(batch, rows, slice(0, rows // 2)), _take(batch, rows, slice(rows // 2, rows))


def _take(value, rows: int, part: slice):
    if isinstance(value, torch.Tensor):
        return value[part] if value.dim() > 0 and value.shape[0] == rows else value
    if isinstance(value, Mapping):  # dicts, and transformers' BatchEncoding
        return type(value)({key: _take(item, rows, part) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return type(value)(_take(item, rows, part) for item in value)
    return value


def _leaves(value):
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


class GradientBackup:
    """The parameters' gradients as they were, kept in host memory (a backup on the device would take the
    memory that just ran out), to undo what a backward that failed midway accumulated."""

    def __init__(self, module: nn.Module) -> None:
        self._saved: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        for p in module.parameters():
            if p.grad is None:
                self._saved.append((p, None))
            else:
                # Into pinned memory the copy is queued, without waiting; the restore is queued after it.
                host = torch.empty_like(p.grad, device="cpu", pin_memory=p.grad.is_cuda)
                self._saved.append((p, host.copy_(p.grad, non_blocking=True)))

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in self._saved:
                if saved is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = saved.to(p.device, non_blocking=True)
                else:
                    p.grad.copy_(saved, non_blocking=True)  # in place: a bucket view stays one
