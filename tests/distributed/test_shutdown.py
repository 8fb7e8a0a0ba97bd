"""Models still alive when the process group is destroyed and the interpreter exits.

Holding the group strongly kept its gloo threads running into interpreter shutdown, where one of
them could abort the process (about one exit in three on two cores): the ranks must exit cleanly,
and destroy_process_group() must end the group's threads.
"""

import gc
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hsync  # in a fresh rank (run_ranks(fresh=True)) imported before its init_process_group, as programs do
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed

_kept_until_exit: list = []


def train_and_keep(rank: int, world_size: int) -> tuple[int, list[str], list[str]]:
    """Models kept alive past destroy_process_group(): the group's gloo threads must end with it (held
    by a model, they ran on into interpreter shutdown, where one could abort the process)."""
    for _ in range(4):
        model = hsync.WeightedDDP(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
        for _ in range(3):
            model.backward(model(torch.randn(4, 32)).sum(), weight=4)
        _kept_until_exit.append(model)
    running = gloo_threads()
    dist.destroy_process_group()
    return len(_kept_until_exit), running, gloo_threads()


def test_processes_exit_cleanly_with_models_alive():
    # run_ranks also fails a rank that returned and then exited abnormally.
    for kept, running, after in run_ranks(train_and_keep, 2):
        assert kept == 4 and running, "gloo threads expected while the group lives"
        assert after == [], "the models kept the process group's threads alive"


def gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path("/proc/self/task", task, "comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended since (hsync's store calls run on short-lived ones)
            continue
    return sorted(name for name in names if "gloo" in name)


def first_optimizer_after_init(rank: int, world_size: int) -> tuple[bool, list[str], list[str]]:
    dynamo_was_loaded = "torch._dynamo" in sys.modules
    model = hsync.WeightedDDP(nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters())  # the process's first: it loads torch._dynamo
    model.backward(model(torch.randn(4, 8)).sum(), weight=4)
    optimizer.step()
    running = gloo_threads()
    dist.destroy_process_group()
    return dynamo_was_loaded, running, gloo_threads()


def test_destroy_process_group_ends_gloo_threads_after_the_first_optimizer():
    # minimal.py's shape: hsync imported, then init_process_group, then the first optimizer. Its
    # imports kept the default group in torch.distributed.nn's defaults, and about one torchrun
    # exit in four aborted ("terminate called without an active exception"). Fresh ranks: those forked
    # from run_ranks' server have torch._dynamo loaded already.
    for dynamo_was_loaded, running, after in run_ranks(first_optimizer_after_init, 2, fresh=True):
        assert not dynamo_was_loaded, "the case needs torch._dynamo first loaded after init_process_group"
        assert running, "gloo threads expected while the group lives"
        assert after == []


_collected_in_worker_s = float("nan")


def _collect_in_worker(worker_id: int) -> None:
    # A thread of the worker's own, as its queue feeder: a destructor that joined or detached the parent's
    # threads failed there with "Invalid argument" and aborted the worker.
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    global _collected_in_worker_s
    begun = time.monotonic()
    gc.collect()
    _collected_in_worker_s = time.monotonic() - begun


class _Timings(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> float:
        return _collected_in_worker_s


def wrappers_collected_in_a_dataloader_worker(rank: int, world_size: int) -> list[float]:
    """Wrappers dropped inside reference cycles, then collected by a forked DataLoader worker's garbage
    collector: Note [Forked children] in csrc/comm/fault_monitor.h."""
    gc.disable()  # the parent must not collect them first
    for _ in range(3):
        model = hsync.WeightedDDP(nn.Linear(8, 1))
        model.backward(model(torch.randn(4, 8)).sum(), weight=4)
        cycle: list = [model]
        cycle.append(cycle)
        del model, cycle
    loader = torch.utils.data.DataLoader(_Timings(), batch_size=2, num_workers=1, worker_init_fn=_collect_in_worker)
    timings = [float(t) for batch in loader for t in batch]
    gc.enable()
    model = hsync.WeightedDDP(nn.Linear(8, 1))  # the parent's group still works
    model.backward(model(torch.randn(4, 8)).sum(), weight=4)
    dist.destroy_process_group()
    return timings


def test_a_dataloader_worker_that_collects_dropped_wrappers_goes_on():
    # Three dropped wrappers cost a worker 6 s (a 2 s wait for each one's missing monitor thread), or aborted it.
    # Now about 0.2 s on an idle machine, 1.3 s once while the suite ran beside it: half the 6 s is the bound.
    for timings in run_ranks(wrappers_collected_in_a_dataloader_worker, 2):
        assert len(timings) == 4
        assert max(timings) < 3.0, f"the worker's garbage collection took {max(timings):.2f} s"


def _used_every_way(model: hsync.WeightedDDP) -> list:
    """Steps through each path that keeps state beside the wrapper; returns what a training loop would hold
    (an optimizer, a Balancer), dropped with the wrapper."""
    x = torch.randn(4, 8)
    with model.no_sync():
        model.backward(model(x).sum(), weight=4)
    model.backward(model(x).sum(), weight=4)
    model(x).sum().backward()
    optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, lr=0.1)
    optimizer.step()
    balancer = hsync.Balancer(model, 16, hsync.BalanceConfig(global_batch_size=8))
    for indices in balancer:
        if balancer.backward(model(torch.randn(len(indices), 8)).sum()):
            break
    with model.join():  # last: torch's Join leaves its joinables joining after the context, as DDP does
        model(x).sum().backward()
        optimizer.step()
    return [optimizer, balancer]


def dropped_wrappers(rank: int, world_size: int) -> tuple[bool, bool]:
    """Whether a dropped torch DDP and a dropped WeightedDDP, each used, are freed with garbage collection off."""
    gc.disable()
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        ddp(torch.randn(4, 8)).sum().backward()
        ddp_freed = weakref.ref(ddp)
        del ddp
        model = hsync.WeightedDDP(nn.Linear(8, 1))
        kept = _used_every_way(model)
        hsync_freed = weakref.ref(model)
        del model, kept
        return ddp_freed() is None, hsync_freed() is None
    finally:
        gc.enable()
        dist.destroy_process_group()


def test_a_dropped_wrapper_is_freed_at_once_as_torchs_ddp_is():
    # The wrapper's Join state held it back: a cycle, freed only by a garbage collection, which kept its buckets (on
    # a GPU, the size of the gradients) until the collector's oldest generation next ran.
    for ddp_freed, hsync_freed in run_ranks(dropped_wrappers, 2):
        assert ddp_freed, "torch's DDP itself was not freed: the case needs another model"
        assert hsync_freed, "a dropped WeightedDDP waited for a garbage collection"
