"""A peer that dies, freezes or runs different collectives: every other rank stops within the
deadline (plus seconds) with an error naming the rank, the collective and the time, and exits."""

import datetime
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.workloads import TINY_BUCKET_MB, make_net, mse
from tests.spawn import run_ranks_expecting_errors, run_ranks_with_victim

pytestmark = pytest.mark.distributed

DEADLINE_S = 3.0
VICTIM = 2
BOARD_READ_AFTER_S = min(2.0, DEADLINE_S / 2)  # FaultMonitor::store_poll_after(): no rank reads a post sooner


def train_until_victim_strikes(rank: int, world_size: int, how: str, deadlines: dict[int, float],
                               device: str = "cpu", history: str = "", regroup: bool = False,
                               store_on_victim: bool = False) -> None:
    """Trains; at step 3 the victim kills or stops itself (`how`: "kill", "stop", or
    "kill-leaving-a-child", whose forked child keeps its sockets open as a DataLoader worker would) in
    the middle of backward, after some buckets went out. The others raise, with the seconds they took
    to notice; with `regroup`, only after destroying the group and staying alive for seconds, as a
    trainer that goes on over the survivors does (hsync.fault_tolerance), so that no peer learns of it
    from an exit. Before, with history
    "subgroup", ranks 0 and VICTIM wrap a model over a group of their own, which rank 1 never sees;
    with "replacement", every rank wraps one, then rank 1 forgets it, as a process that replaced a
    failed one would never have seen it. With `store_on_victim`, the group's store is served by the
    victim, as rank 0 serves it under init_process_group's env:// and a replica serves torchft's quorum."""
    import hsync

    if store_on_victim:
        group_on_a_store_of_the_victims(rank, world_size)

    if device == "cuda":
        torch.cuda.set_device(0)
    if history == "subgroup":
        subgroup = dist.new_group([0, VICTIM])
        if rank in (0, VICTIM):
            hsync.WeightedDDP(make_net(seed=0).to(device), process_group=subgroup)
    elif history == "replacement":
        hsync.WeightedDDP(make_net(seed=0).to(device))
        if rank == 1:
            hsync.bootstrap._engines_built.clear()
    timeout = datetime.timedelta(seconds=deadlines.get(rank, DEADLINE_S))
    model = hsync.WeightedDDP(make_net(seed=0).to(device), bucket_cap_mb=TINY_BUCKET_MB, timeout=timeout)
    if store_on_victim:  # a run some way in, whose monitors have read which peers share their host
        time.sleep(1.0)
    if rank == VICTIM:
        strike = {"kill": signal.SIGKILL, "kill-leaving-a-child": signal.SIGKILL, "stop": signal.SIGSTOP}[how]
        step = {"now": 0}

        def victim_strikes(_: torch.Tensor) -> None:
            if step["now"] != 3:
                return
            if how == "kill-leaving-a-child" and os.fork() == 0:  # as a DataLoader worker, it holds the sockets
                time.sleep(3 * DEADLINE_S)
                os._exit(0)
            os.kill(os.getpid(), strike)

        model.module.inp.weight.register_hook(victim_strikes)
    for step_index in range(6):
        if rank == VICTIM:
            step["now"] = step_index
        x = torch.randn(4, 4, dtype=torch.float64, device=device)
        loss = mse(model(x), torch.zeros(4, dtype=torch.float64, device=device))
        started = time.monotonic()
        try:
            model.backward(loss, weight=4)
        except RuntimeError as error:
            noticed = time.monotonic() - started
            if regroup:
                dist.destroy_process_group()
                time.sleep(2 * DEADLINE_S)
            raise RuntimeError(f"noticed after {noticed:.2f} s at step {step_index}: {error}") from None
    raise AssertionError(f"rank {rank} finished training although rank {VICTIM} was gone")


def group_on_a_store_of_the_victims(rank: int, world_size: int) -> None:
    """Replaces the default group with one whose store the VICTIM serves."""
    harness_store = dist.distributed_c10d._get_default_store()
    if rank == VICTIM:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        harness_store.set("victims-store", str(store.port))
    else:
        harness_store.wait(["victims-store"], datetime.timedelta(seconds=30))
        port = int(harness_store.get("victims-store"))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def noticed_after(error: str) -> float:
    return float(re.search(r"noticed after ([0-9.]+) s", error).group(1))


def test_killed_peer_fails_every_survivor_at_once():
    survivors = run_ranks_with_victim(train_until_victim_strikes, 4, VICTIM, "kill", {}, timeout=60)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing"
        # Its own broken connection to the dead rank, or a peer's post of one (Note [Failing fast]).
        own = re.search(rf"hsync: rank {rank} \(gloo\): all-reduce #\d+ .* A peer probably exited", survivor.error)
        told = re.search(rf"hsync: rank {rank} \(gloo\): stopped .*a peer failed first", survivor.error)
        assert own or told, survivor.error
        assert noticed_after(survivor.error) < 3.0, survivor.error
        assert survivor.exitcode == 0, f"rank {rank}: {survivor}"  # the harness reported the error and exited


def test_a_survivor_that_regroups_lets_go_of_the_failed_groups_connections_at_once():
    # In the ring all-reduce of four ranks, rank 0 exchanges nothing with the victim (rank 2): it learns of
    # the loss only when a survivor's connection to it closes, or from the board after seconds of waiting.
    # A survivor's failed collective must not keep its later ones (and with them gloo's connections) alive
    # past the group's destruction (Note [Failing fast]).
    survivors = run_ranks_with_victim(train_until_victim_strikes, 4, VICTIM, "kill", {}, "cpu", "", True,
                                      timeout=60, until_exit=False)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing"
        assert re.search(rf"hsync: rank {rank} \(gloo\): all-reduce #\d+ .* failed after", survivor.error), \
            survivor.error
        assert noticed_after(survivor.error) < BOARD_READ_AFTER_S, survivor.error


def test_a_peer_that_died_with_its_connections_left_open_fails_every_survivor_before_the_deadline():
    # A process forked from the victim keeps its sockets open, so no survivor sees a connection close and none
    # has a failure to post: each names the exited process once it has waited to poll the board (Note [A dead
    # peer with open connections]), not at the deadline.
    survivors = run_ranks_with_victim(train_until_victim_strikes, 3, VICTIM, "kill-leaving-a-child", {},
                                      timeout=60, until_exit=False)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing"
        assert re.search(rf"hsync: rank \d \(gloo\): all-reduce #\d+ .* cannot complete after [0-9.]+ s: a peer "
                         rf"exited .* left open .*; rank {VICTIM} \(process \d+, on this host\) has exited",
                         survivor.error), survivor.error
        assert BOARD_READ_AFTER_S - 0.1 < noticed_after(survivor.error) < DEADLINE_S, survivor.error


@pytest.mark.parametrize("how", ["kill-leaving-a-child", "stop"])
def test_a_lost_peer_that_served_the_store_fails_every_survivor_within_the_deadline(how):
    # The victim serves the group's store: a survivor's calls to it get no answer, whether the victim is stopped
    # or dead with its child holding the store's connections. Which peers share its host must have been read
    # before (Note [A dead peer with open connections]), and the waits for the store must hold up no deadline.
    survivors = run_ranks_with_victim(train_until_victim_strikes, 3, VICTIM, how, {}, "cpu", "", False, True,
                                      timeout=60, until_exit=False)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing"
        if how == "stop":
            assert "did not complete within the 3.00 s deadline" in survivor.error, survivor.error
            # The names of those not there come from the store, given up on after 2 s (kPostLimit).
            assert DEADLINE_S - 0.1 < noticed_after(survivor.error) < DEADLINE_S + 2.5, survivor.error
        else:
            assert re.search(rf"a peer exited .* left open .*; rank {VICTIM} \(process \d+, on this host\) has "
                             rf"exited", survivor.error), survivor.error
            assert BOARD_READ_AFTER_S - 0.1 < noticed_after(survivor.error) < DEADLINE_S, survivor.error


def test_frozen_peer_fails_every_survivor_at_the_deadline():
    survivors = run_ranks_with_victim(train_until_victim_strikes, 3, VICTIM, "stop", {}, timeout=60)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing"
        assert "did not complete within the 3.00 s deadline" in survivor.error, survivor.error
        assert "at step 3" in survivor.error, survivor.error
        assert DEADLINE_S - 0.1 < noticed_after(survivor.error) < DEADLINE_S + 2, survivor.error
        # Gloo's own deadline frees its thread, so the process exits instead of hanging in teardown.
        assert survivor.exitcode == 0 and survivor.exited_after is not None, f"rank {rank}: {survivor}"


@pytest.mark.parametrize("history", ["", "subgroup", "replacement"])
def test_a_rank_that_gives_up_tells_its_peers(history):
    # Rank 0 gives up on the frozen rank after 2 s; rank 1 would wait 60 s, but reads rank 0's post,
    # under the same key though rank 1 built, or remembers, one wrapper fewer. (Its exit then waits
    # for gloo's own 60 s deadline, which frees gloo's thread: the test ends when both have reported.)
    survivors = run_ranks_with_victim(train_until_victim_strikes, 3, VICTIM, "stop", {0: 2.0, 1: 60.0}, "cpu",
                                      history, timeout=20, until_exit=False)
    first, told = survivors[0].error, survivors[1].error
    assert first is not None and "did not complete within the 2.00 s deadline" in first, first
    # Rank 1 posts its wait only after 2 s of it, as rank 0's deadline passes: it is given the time to, and is
    # not named beside the frozen rank.
    assert f"; rank {VICTIM} has not reached it" in first, first
    assert told is not None and "hsync: rank 1 (gloo): stopped waiting for all-reduce #" in told, told
    assert "a peer failed first. hsync: rank 0 (gloo)" in told, told
    assert noticed_after(told) < 2.0 + 1.0, told


def mismatched_calls(rank: int, world_size: int, case: str) -> None:
    import hsync
    from hsync.collectives import Channels

    model = hsync.WeightedDDP(make_net(seed=0), timeout=datetime.timedelta(seconds=20))
    loss = mse(model(torch.randn(4, 4, dtype=torch.float64)), torch.zeros(4, dtype=torch.float64))
    if case == "plain-vs-weighted" and rank == 1:
        loss.backward()
    elif case == "channel-vs-weighted" and rank == 0:
        Channels.of_model(model).all_reduce_sum(torch.ones(1), "a metric of the loop's")
    else:
        model.backward(loss, weight=4)


STEP_SCALARS = "all-reduce #2 of the step scalars (6 x Double)"


@pytest.mark.parametrize(("case", "rank0_issues", "rank1_issues"), [
    ("plain-vs-weighted", [STEP_SCALARS] * 2, "all-reduce #2 of bucket 0"),
    # A collective's label is known on the rank that gave it.
    ("channel-vs-weighted", ["all-reduce #2 of a metric of the loop's (1 x Float)",
                             "all-reduce #2 of a collective of hsync's Python side, named on its rank (1 x Float)"],
     STEP_SCALARS),
])
def test_debug_mode_names_a_collective_mismatch(case, rank0_issues, rank1_issues):
    errors = run_ranks_expecting_errors(mismatched_calls, 2, case, timeout=60, env={"HSYNC_DEBUG_COLLECTIVES": "1"})
    for error, told in zip(errors, rank0_issues, strict=True):
        assert f"collective mismatch: rank 0 issues {told}, rank 1 issues {rank1_issues}" in error, error
