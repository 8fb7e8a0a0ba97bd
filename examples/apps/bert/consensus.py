"""Decisions every rank takes together, so a problem on one rank stops all of them instead of
leaving the others waiting in a collective; under hsync's collective deadline (hsync/collectives.py)."""

from __future__ import annotations

from hsync.collectives import Channels


def fail_together(problem: str | None, what: str) -> None:
    """Collective: exits every rank with the first rank's problem, if any rank has one."""
    problems = Channels.of_group().gather_objects(problem, f"the ranks' problems ({what})")
    first = next(((rank, p) for rank, p in enumerate(problems) if p), None)
    if first:
        raise SystemExit(f"hsync: {what} (rank {first[0]}): {first[1]}")


def agree(value, what: str) -> bool:
    """Collective: whether every rank holds the same value (`what` names it if a peer fails to answer)."""
    values = Channels.of_group().gather_objects(value, what)
    return all(v == values[0] for v in values)
