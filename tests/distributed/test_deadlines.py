"""Every collective hsync issues has the deadline, not only a weighted step's: a plain step, the buffers, a step
under Join, sum_over_ranks, a Balancer's check, the wrap-time check, the BERT application's decisions. A peer
that freezes (SIGSTOP) or dies (SIGKILL) while the other rank is inside one ends it with an error naming the
collective, within the deadline plus a few seconds."""

import datetime
import os
import re
import signal
import time

import pytest
import torch
from torch import nn

from tests.spawn import run_ranks_with_victim

pytestmark = pytest.mark.distributed

DEADLINE_S = 3.0
VICTIM = 1


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def step(model, rank: int) -> None:
    model(torch.randn(4, 4, device=model.device)).square().mean().backward()


def sum_over_ranks(model, rank: int) -> None:
    import hsync

    hsync.sum_over_ranks({"right": 3.0, "count": 4.0})


def join(model, rank: int) -> None:
    with model.join():  # the survivor's forward tells the joined ranks what follows: a collective of hsync's
        step(model, rank)


def buffers(model, rank: int) -> None:
    model.sync_buffers()


def balancer(model, rank: int) -> None:
    import hsync

    hsync.Balancer(model, 64, hsync.BalanceConfig(global_batch_size=8))


def wrap(model, rank: int) -> None:
    import hsync

    hsync.WeightedDDP(net().to(model.device), timeout=datetime.timedelta(seconds=DEADLINE_S))


def bert_decision(model, rank: int) -> None:
    from hsync.apps.bert.consensus import agree

    agree("a corpus digest", "the corpus digest")  # the BERT application's decisions, before any model exists


COLLECTIVES = {"plain-step": step, "sum-over-ranks": sum_over_ranks, "join": join, "buffers": buffers,
               "balancer": balancer, "wrap": wrap, "bert-decision": bert_decision}


def collective_without_its_peer(rank: int, world_size: int, where: str, how: str, device: str = "cpu") -> None:
    """Each collective once with every rank, then the victim kills or stops itself and the survivor runs it
    again: it raises, with the seconds it took."""
    import hsync

    os.environ["HSYNC_TIMEOUT"] = str(DEADLINE_S)  # sum_over_ranks' deadline
    if device == "cuda":
        torch.cuda.set_device(0)
    # Buffers only where asked for (sync_buffers): a plain step's forward would broadcast them first.
    model = hsync.WeightedDDP(net().to(device), timeout=datetime.timedelta(seconds=DEADLINE_S),
                              forward_sync_buffers=False)
    collective = COLLECTIVES[where]
    collective(model, rank)  # whatever the first call builds (a channel, connections) is there
    if rank == VICTIM:
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[how])
    time.sleep(0.2)  # the victim is gone
    started = time.monotonic()
    try:
        collective(model, rank)
    except RuntimeError as error:
        raise RuntimeError(f"noticed after {time.monotonic() - started:.2f} s: {error}") from None
    raise AssertionError(f"rank {rank} went on although rank {VICTIM} was gone")


@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("where", list(COLLECTIVES))
def test_a_lost_peer_ends_every_collective_of_hsyncs_within_the_deadline(where, how):
    # Reported, not waited out: torch's own Join all-reduce of a forward may hold the survivor's exit until
    # its process group's timeout, and that collective is torch's.
    survivor = run_ranks_with_victim(collective_without_its_peer, 2, VICTIM, where, how, timeout=40,
                                     until_exit=False)[0]
    assert survivor.error is not None, f"the survivor raised nothing: {survivor}"
    noticed = float(re.search(r"noticed after ([0-9.]+) s", survivor.error).group(1))
    assert noticed < DEADLINE_S + 2.0, survivor.error
    assert "hsync: rank 0 (gloo): " in survivor.error, survivor.error
    if how == "stop":
        assert f"did not complete within the {DEADLINE_S:.2f} s deadline" in survivor.error, survivor.error
        assert noticed > DEADLINE_S - 0.5, survivor.error
    else:
        assert "A peer probably exited" in survivor.error or "did not complete" in survivor.error, survivor.error
