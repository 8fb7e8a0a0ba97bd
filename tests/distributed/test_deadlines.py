"""Every collective hsync issues has the deadline, not only a weighted step's: a plain step, the buffers, a step
under Join, sum_over_ranks, a Balancer's check, the wrap-time check, the BERT application's decisions. A peer
that freezes (SIGSTOP) or dies (SIGKILL) while the other rank is inside one ends it with an error naming the
collective, within the deadline plus a few seconds; a frozen one is named."""

import datetime
import os
import re
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.spawn import run_ranks_expecting_errors, run_ranks_with_victim

pytestmark = pytest.mark.distributed

DEADLINE_S = 3.0
VICTIM = 1


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def step(model, rank: int) -> None:
    model(torch.randn(4, 4, device=model.device)).square().mean().backward()


def weighted_step(model, rank: int) -> None:
    model.backward(model(torch.randn(4, 4, device=model.device)).square().mean(), weight=4)


def allreduce_hook(state, bucket):  # a user's own hook, in hsync's chain of hooked buckets: Note [Hook order]
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def hooked_step(model, rank: int) -> None:
    if not model._hook_registered:
        model.register_comm_hook(None, allreduce_hook)
    step(model, rank)


def sum_over_ranks(model, rank: int) -> None:
    import hsync

    hsync.sum_over_ranks({"right": 3.0, "count": 4.0})


def join(model, rank: int) -> None:
    with model.join():  # the survivor's forward tells the joined ranks what follows: a collective of hsync's
        step(model, rank)


def joined(model, rank: int) -> None:
    with model.join():  # rank 0 has no inputs: it waits in torch's Join, on its all-reduce of the ranks not joined
        if rank != 0:
            step(model, rank)


def buffers(model, rank: int) -> None:
    model.sync_buffers()


def refresh(model, rank: int) -> None:
    model.refresh_trainable_parameters()  # nothing unfrozen: its one all-reduce


def balancer(model, rank: int) -> None:
    import hsync

    hsync.Balancer(model, 64, hsync.BalanceConfig(global_batch_size=8))


def wrap(model, rank: int) -> None:
    import hsync

    device = "cpu" if model is None else model.device
    hsync.WeightedDDP(net().to(device), timeout=datetime.timedelta(seconds=DEADLINE_S))


def bert_decision(model, rank: int) -> None:
    from apps.bert.consensus import agree

    agree("a corpus digest", "the corpus digest")  # the BERT application's decisions, before any model exists


COLLECTIVES = {"plain-step": step, "weighted-step": weighted_step, "hooked-step": hooked_step,
               "sum-over-ranks": sum_over_ranks, "join": join, "joined": joined, "buffers": buffers, "refresh": refresh,
               "balancer": balancer, "wrap": wrap, "bert-decision": bert_decision}


def collective_without_its_peer(rank: int, world_size: int, where: str, how: str, device: str = "cpu") -> None:
    """Each collective once with every rank, then the victim kills or stops itself and the survivor runs it
    again: it raises, with the seconds it took."""
    import hsync

    os.environ["HSYNC_TIMEOUT"] = str(DEADLINE_S)  # sum_over_ranks' deadline
    if device == "cuda":
        torch.cuda.set_device(0)
    # Buffers only where asked for (sync_buffers): a plain step's forward would broadcast them first. A weighted
    # step with bucket views waits for its scalars inside backward, then again as it completes.
    model = hsync.WeightedDDP(net().to(device), timeout=datetime.timedelta(seconds=DEADLINE_S),
                              forward_sync_buffers=False, gradient_as_bucket_view=where == "weighted-step")
    collective = COLLECTIVES[where]
    collective(model, rank)  # whatever the first call builds (a channel, connections) is there
    if rank == VICTIM:
        if how == "kill-leaving-a-child" and os.fork() == 0:  # as a DataLoader worker, it holds the sockets
            time.sleep(3 * DEADLINE_S)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    time.sleep(0.2)  # the victim is gone
    started = time.monotonic()
    try:
        collective(model, rank)
    except RuntimeError as error:
        shown = "".join(traceback.format_exception(error))
        said_twice = " [said twice]" if "During handling of the above exception" in shown else ""
        raise RuntimeError(f"noticed after {time.monotonic() - started:.2f} s: {error}{said_twice}") from None
    raise AssertionError(f"rank {rank} went on although rank {VICTIM} was gone")


def seconds_to_notice(error: str) -> float:
    """The seconds a survivor's "noticed after ... s" error says it took."""
    found = re.search(r"noticed after ([0-9.]+) s", error)
    assert found, f"the survivor raised something else:\n{error}"
    return float(found.group(1))


@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("where", list(COLLECTIVES))
def test_a_lost_peer_ends_every_collective_of_hsyncs_within_the_deadline(where, how):
    survivor = run_ranks_with_victim(collective_without_its_peer, 2, VICTIM, where, how, timeout=40)[0]
    assert survivor.error is not None, f"the survivor raised nothing: {survivor}"
    noticed = seconds_to_notice(survivor.error)
    assert noticed < DEADLINE_S + 2.0, survivor.error
    assert "hsync: rank 0 (gloo): " in survivor.error, survivor.error
    assert "[said twice]" not in survivor.error, survivor.error  # a backward that met the failure, then the step
    if how == "stop":
        assert f"did not complete within the {DEADLINE_S:.2f} s deadline" in survivor.error, survivor.error
        assert f"rank {VICTIM} has not reached it" in survivor.error, survivor.error  # the frozen rank, named
        assert noticed > DEADLINE_S - 0.5, survivor.error
    else:
        assert "A peer probably exited" in survivor.error or "did not complete" in survivor.error, survivor.error
        if "A peer probably exited" in survivor.error:  # the dead rank, named from its process
            assert re.search(f"rank {VICTIM} \\(process [0-9]+, on this host\\) has exited", survivor.error), \
                survivor.error


def first_collective_without_its_peer(rank: int, world_size: int, where: str, how: str) -> None:
    """The victim freezes or dies before its first call of hsync's: the survivor's first collective waits for it."""
    os.environ["HSYNC_TIMEOUT"] = str(DEADLINE_S)
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    started = time.monotonic()
    try:
        wrap(None, rank) if where == "wrap" else sum_over_ranks(None, rank)
    except RuntimeError as error:
        raise RuntimeError(f"noticed after {time.monotonic() - started:.2f} s: {error}") from None
    raise AssertionError(f"rank {rank} went on although rank {VICTIM} was gone")


@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("where", ["wrap", "sum-over-ranks"])
def test_a_peer_lost_before_the_first_collective_is_named(where, how):
    # The first collective was numbered 0, which also stood for none: a frozen rank went unnamed. A dead one had
    # posted no process to be found by.
    survivor = run_ranks_with_victim(first_collective_without_its_peer, 2, VICTIM, where, how, timeout=40)[0]
    named = (f"did not complete within the {DEADLINE_S:.2f} s deadline.*; rank {VICTIM} has not reached it"
             if how == "stop" else f"A peer probably exited .*; rank {VICTIM} never reached this communicator")
    assert re.search(f"#1 of .*{named}", survivor.error), survivor.error


def store_host_frozen(rank: int, world_size: int) -> None:
    """The default group made anew over a store that rank 0 hosts (as init_process_group's env:// does without
    torchrun's agent); then rank 0 freezes, its store with it."""
    import hsync

    exchange = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        exchange.set("port of rank 0's store", str(store.port))
    else:
        store = dist.TCPStore("127.0.0.1", int(exchange.get("port of rank 0's store")), world_size, is_master=False)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    model = hsync.WeightedDDP(net(), timeout=datetime.timedelta(seconds=DEADLINE_S))
    step(model, rank)
    time.sleep(0.5)  # every rank has read its peers' processes from the board
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    step(model, rank)
    raise AssertionError(f"rank {rank} went on although rank 0 was stopped")


def test_a_frozen_rank_whose_store_is_frozen_with_it_is_named():
    # The board, in rank 0's store, did not answer: the survivor was told only that a peer was stopped or slow.
    survivor = run_ranks_with_victim(store_host_frozen, 2, 0, timeout=40)[1]
    assert re.search(f"did not complete within the {DEADLINE_S:.2f} s deadline.*; rank 0 \\(process [0-9]+, on this "
                     "host\\) is stopped", survivor.error), survivor.error


@pytest.mark.parametrize("where", list(COLLECTIVES))
def test_a_dead_peer_whose_connections_stay_open_ends_every_collective_of_hsyncs_before_the_deadline(where):
    # No connection closes: the survivor names the exited process once it has waited half the deadline (Note [A
    # dead peer with open connections]).
    survivor = run_ranks_with_victim(collective_without_its_peer, 2, VICTIM, where, "kill-leaving-a-child",
                                     timeout=40)[0]
    assert survivor.error is not None, f"the survivor raised nothing: {survivor}"
    assert re.search(f"hsync: rank 0 \\(gloo\\): .* cannot complete after [0-9.]+ s: a peer exited .*; rank {VICTIM} "
                     "\\(process [0-9]+, on this host\\) has exited", survivor.error), survivor.error
    assert DEADLINE_S / 2 - 0.1 < seconds_to_notice(survivor.error) < DEADLINE_S, survivor.error


@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("where", ["plain-step", "hooked-step"])
def test_the_survivors_name_the_lost_rank_not_each_other(where, how):
    """Three ranks, one frozen or dead. The frozen: the survivors wait for the same collective and post it, so
    each error (the one past its deadline, and the one that learns of it from the board) names the frozen rank
    alone. The dead: its process, posted when the communicator started, has exited."""
    survivors = run_ranks_with_victim(collective_without_its_peer, 3, VICTIM, where, how, timeout=40)
    named = {"stop": f"; rank {VICTIM} has not reached it(\\.|$)",
             "kill": f"A peer probably exited .*; rank {VICTIM} \\(process [0-9]+, on this host\\) has exited"}[how]
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing: {survivor}"
        assert re.search(named, survivor.error.strip(), re.DOTALL), survivor.error
        assert "rank 0 (process" not in survivor.error and "rank 2 (process" not in survivor.error, survivor.error


def lost_before_its_sharded_step(rank: int, world_size: int, how: str) -> None:
    """Three ranks, a ShardedOptimizer owning two buckets a rank; the victim freezes or dies between its backward
    and its optimizer step. Each owner broadcasts its updated parameters: a survivor whose piece of rank 0's
    broadcast has arrived goes on to rank 1's, so the survivors wait at different collectives."""
    import hsync

    model = hsync.WeightedDDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]), bucket_cap_mb=0.02,
                              timeout=datetime.timedelta(seconds=DEADLINE_S))
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.01)
    for step_index in range(2):
        model(torch.randn(8, 64)).square().mean().backward()
        if step_index == 1 and rank == VICTIM:
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        started = time.monotonic()
        try:
            optimizer.step()
        except RuntimeError as error:
            raise RuntimeError(f"noticed after {time.monotonic() - started:.2f} s: {error}") from None
        optimizer.zero_grad()
    raise AssertionError(f"rank {rank} went on although rank {VICTIM} was stopped")


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_survivors_at_different_collectives_name_the_lost_rank_alone(how):
    # A survivor posted as waiting at a later collective has passed the one a peer's deadline ran out on: it was
    # named as not there, beside the frozen rank. A dead one is named from its process, within the deadline.
    survivors = run_ranks_with_victim(lost_before_its_sharded_step, 3, VICTIM, how, timeout=40)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing: {survivor}"
        assert "the parameters a ShardedOptimizer's step updated" in survivor.error, survivor.error
        if how == "stop":
            assert re.search(f"; rank {VICTIM} has not reached it(\\.|$)", survivor.error.strip()), survivor.error
            assert "have not reached it" not in survivor.error, survivor.error
        else:
            assert re.search(f"rank {VICTIM} \\(process [0-9]+, on this host\\) has exited", survivor.error), \
                survivor.error
            assert seconds_to_notice(survivor.error) < DEADLINE_S, survivor.error


def collectives_that_differ(rank: int, world_size: int) -> str:
    """A user's mistake: rank 0 steps its ShardedOptimizer (rank 1 owns the one parameter: a broadcast from rank 1),
    rank 1 makes its buffers rank 0's (a broadcast from rank 0), under the same collective number. Each waits for
    the other to send (nothing sent, so gloo mixes no data)."""
    import hsync

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 1, bias=False), nn.BatchNorm1d(1, affine=False))
    model = hsync.WeightedDDP(module, timeout=datetime.timedelta(seconds=DEADLINE_S))
    optimizer = hsync.ShardedOptimizer(model, torch.optim.SGD, memory_budget=["1KiB", "1MiB"], lr=0.01)
    assert optimizer.layout.owned == ((), (0,)), optimizer.layout
    model.backward(model(torch.randn(4, 4)).square().mean(), weight=4)
    optimizer.step() if rank == 0 else model.sync_buffers()
    raise AssertionError("went on")


def test_ranks_in_different_collectives_under_one_number_are_told_so():
    # Each was told only that a peer was stopped, hung or slow.
    errors = run_ranks_expecting_errors(collectives_that_differ, 2, timeout=40)
    if os.environ.get("HSYNC_DEBUG_COLLECTIVES") == "1":  # compared before they run: named at once, not at the deadline
        for error in errors:
            assert re.search(r"collective mismatch: rank 0 issues broadcast #[0-9]+ of .* from rank 1 .*, rank 1 "
                             r"issues broadcast #[0-9]+ of .* from rank 0", error), error
        return
    assert re.search(r"; rank 1 waits in broadcast #[0-9]+ of the buffers \(sync_buffers\) from rank 0 \(.*\) "
                     r"instead: the ranks issued different collectives", errors[0]), errors[0]
    assert re.search(r"; rank 0 waits in broadcast #[0-9]+ of the parameters a ShardedOptimizer's step updated from "
                     r"rank 1 \(.*\) instead: the ranks issued different collectives", errors[1]), errors[1]


def failure_seen_in_another_group(rank: int, world_size: int) -> None:
    """Rank 0 works with rank 2 in one group (a short deadline) and with rank 1 in another (a long one). Rank 2
    freezes; rank 0 sees it and stays alive (as a rank writing a checkpoint would), so nothing closes the
    sockets rank 1 waits on: only rank 0's failure, spread to its other communicators, ends rank 1's wait."""
    from hsync.collectives import Channels

    with_victim, with_survivor = dist.new_group([0, 2]), dist.new_group([0, 1])
    if rank in (0, 2):
        Channels.of_group(with_victim, timeout_s=DEADLINE_S).barrier("work with rank 2")
    if rank in (0, 1):
        Channels.of_group(with_survivor, timeout_s=60.0).barrier("work with rank 1")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.2)
    started = time.monotonic()
    try:
        if rank == 0:
            Channels.of_group(with_victim, timeout_s=DEADLINE_S).barrier("work with rank 2")
        else:
            Channels.of_group(with_survivor, timeout_s=60.0).barrier("work with rank 1")
    except RuntimeError as error:
        if rank == 0:
            time.sleep(DEADLINE_S + 5.0)  # alive, its sockets open, past the time rank 1 has to notice
        raise RuntimeError(f"noticed after {time.monotonic() - started:.2f} s: {error}") from None
    raise AssertionError(f"rank {rank} went on although rank 2 was stopped")


def test_a_rank_that_failed_in_one_group_ends_its_peers_waits_in_every_other():
    survivor = run_ranks_with_victim(failure_seen_in_another_group, 3, 2, timeout=40, until_exit=False)[1]
    assert survivor.error is not None, f"rank 1 raised nothing: {survivor}"
    noticed = seconds_to_notice(survivor.error)
    # Rank 0's deadline, then rank 1's first look at its board (FaultMonitor::kStorePollAfter) and a poll.
    assert noticed < DEADLINE_S + 2.0 + 2.0, survivor.error
    # In debug mode (HSYNC_DEBUG_COLLECTIVES) the wait is for the fingerprints of the same collective.
    fingerprints = r"(all-reduce #2 of the debug fingerprints of )?"
    assert re.search(f"hsync: rank 1 \\(gloo\\): stopped waiting for {fingerprints}all-reduce #2 of work with rank 1",
                     survivor.error), survivor.error
    assert re.search(f"a peer failed first. hsync: rank 0 \\(gloo\\): {fingerprints}all-reduce #2 of work with rank 2",
                     survivor.error), survivor.error
    assert f"did not complete within the {DEADLINE_S:.2f} s deadline" in survivor.error
