"""Decisions every rank takes together, so a problem on one rank stops all of them instead of
leaving the others waiting in a collective."""

from __future__ import annotations

import torch.distributed as dist


def fail_together(problem: str | None, what: str) -> None:
    """Collective: exits every rank with the first rank's problem, if any rank has one."""
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next(((rank, p) for rank, p in enumerate(problems) if p), None)
    if first:
        raise SystemExit(f"hsync: {what} (rank {first[0]}): {first[1]}")


def agree(value) -> bool:
    """Collective: whether every rank holds the same value."""
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)
