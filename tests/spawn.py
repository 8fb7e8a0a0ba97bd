"""Runs a function on N real processes joined by torch.distributed, as torch's own distributed tests do.

Each rank is a fresh process (forked from a server that has imported torch, so no state of a test
reaches the next) with its own process group, met at a store that the caller serves as torchrun's
agent does; the caller gets every rank's return value, or the first rank's traceback. A deadline
bounds every run: a rank that hangs fails the test instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a fresh rank imports this module first: torch only when a test's own imports need it
    import torch.distributed as dist


def free_port() -> int:
    """A port free now, for a launcher that binds it itself (a rendezvous endpoint). Any process's connection may
    take it before then: a store for ranks comes from served_store instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_store() -> dist.TCPStore:
    """A store served from this process, as torchrun's agent serves one: the ranks are its clients (they find it at
    its .port), and it outlives any of them. Its port is taken as it binds; a port found free and handed on
    was once taken in between by another test's connection, and two tests' ranks met."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _entry(rank: int, world_size: int, port: int, backend: str, env: dict[str, str], fn: Callable,
           args: tuple, results: mp.Queue) -> None:
    os.environ.update({key: value.format(rank=rank) for key, value in env.items()})
    # A rank started by the fork server inherits its start method; a launched program has the platform's
    # default, which starts its DataLoader's workers in milliseconds (fork on Linux) rather than seconds.
    mp.set_start_method(None, force=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    finished = False
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        # Every rank connected before any runs fn: one that closed its group at once (a test of a program that
        # starts its own) would fail a peer still connecting ("Gloo connectFullMesh failed ... closed by peer").
        store.set(f"connected/{rank}", "1")
        store.wait([f"connected/{r}" for r in range(world_size)], datetime.timedelta(seconds=60))
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
        finished = True
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            from hsync.collectives import end_process_group

            if finished:
                end_process_group()
            else:
                dist.destroy_process_group()  # why not end_process_group: its docstring


def _start(fn: Callable, world_size: int, args: tuple, backend: str, env: dict[str, str] | None,
           fresh: bool = False) -> tuple[list[mp.Process], mp.Queue, dist.TCPStore]:
    """The ranks, started; the queue of their results; the store they meet at (keep it until they are done)."""
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    # The server imports these once; each rank is then forked from it in milliseconds, with nothing
    # started yet that a fork could break (no thread, no process group, no CUDA context). torch._dynamo
    # is what a wrapper's first forward imports: 1.1 s in every rank of every test otherwise; the frameworks
    # (tests/framework_imports.py) 5 to 10 s, imported there only if the tests collected here use them.
    if not fresh:
        frameworks = any(name in sys.modules for name in ("transformers", "accelerate", "lightning"))
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "hsync"] +
                                   ["tests.framework_imports"] * frameworks)
    results = ctx.Queue()
    store = served_store()
    procs = [ctx.Process(target=_entry, args=(r, world_size, store.port, backend, env or {}, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, results, store


_FAILED_RUN_GRACE_S = 5.0
_DEAD_RESULT_GRACE_S = 2.0


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 90.0, env: dict[str, str] | None = None, fresh: bool = False) -> list[Any]:
    """Calls fn(rank, world_size, *args) on each rank; returns the results in rank order.

    `env` is set in each rank before fn runs and before its process group starts (the ranks inherit the
    environment of the server they fork from, not the caller's), but after fn's module is imported to
    unpickle fn, which may already have started CUDA: fit for NCCL's variables, too late for
    CUDA_VISIBLE_DEVICES. "{rank}" in a value becomes the rank. `fresh`: each rank a new interpreter that
    imports only fn's module (seconds slower), for a test of what a program's first imports do."""
    procs, results, _store = _start(fn, world_size, args, backend, env, fresh)
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    finished = False
    dead_since: float | None = None
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(values))
                dead = {r: procs[r].exitcode for r in missing if procs[r].exitcode is not None}
                # A rank that crashed (an abort, a signal) sends nothing: say so now, not at the deadline. The
                # grace lets a result that a rank queued just before it exited arrive.
                dead_since = (dead_since or time.monotonic()) if dead else None
                if dead and time.monotonic() - dead_since > _DEAD_RESULT_GRACE_S:
                    raise AssertionError(f"ranks exited without a result (rank: exit code) {dead}") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
                continue
            if not ok:
                raise RankError(rank, payload)
            values[rank] = pickle.loads(payload)
        finished = True
    finally:
        # After a failure (a rank's error, pytest-timeout's interrupt) the others are likely waiting in a
        # collective that will not complete: a few seconds' grace, not the rest of the deadline.
        stop_by = deadline if finished else min(deadline, time.monotonic() + _FAILED_RUN_GRACE_S)
        for p in procs:
            p.join(timeout=max(0.1, stop_by - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    # A rank that returned its result and then crashed on the way out still fails the test.
    crashed = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
    if crashed:
        raise AssertionError(f"ranks exited abnormally after finishing (rank: exit code) {crashed}")
    return [values[r] for r in range(world_size)]


def run_ranks_expecting_errors(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                               env: dict[str, str] | None = None) -> list[str]:
    """Like run_ranks for a fn that must raise on every rank; returns each rank's traceback."""
    return run_ranks(_capture_error, world_size, fn, *args, timeout=timeout, env=env)


def _capture_error(rank: int, world_size: int, fn: Callable, *args: Any) -> str:
    try:
        fn(rank, world_size, *args)
    except Exception:  # noqa: BLE001 - the error is the result
        return traceback.format_exc()
    raise AssertionError(f"rank {rank} raised no error")


@dataclass
class Survivor:
    """How one rank other than the victim ended."""

    error: str | None
    """Its traceback, if fn raised (None if it returned)."""
    exitcode: int | None
    """The process's exit code; None if it was still running when the harness gave up and killed it."""
    exited_after: float | None
    """Seconds from the start of the run to the process's exit, to within 50 ms."""


def run_ranks_with_victim(fn: Callable[..., Any], world_size: int, victim: int, *args: Any, timeout: float = 60.0,
                          backend: str = "gloo", env: dict[str, str] | None = None,
                          until_exit: bool = True) -> dict[int, Survivor]:
    """Runs fn on every rank while the `victim` rank kills or stops itself; reports on the others.

    Waits until every other rank's process has exited (with until_exit False: has exited or reported
    how fn ended), or `timeout`, then kills whatever is left, the victim included, so nothing outlives
    the test."""
    procs, results, _store = _start(fn, world_size, args, backend, env)
    started = time.monotonic()
    exited: dict[int, float] = {}
    errors: dict[int, str | None] = {}
    others = [r for r in range(world_size) if r != victim]

    def done(r: int) -> bool:
        return r in exited or (not until_exit and r in errors)

    try:
        while time.monotonic() - started < timeout and not all(done(r) for r in others):
            for r in others:
                if r not in exited and not procs[r].is_alive():
                    exited[r] = time.monotonic() - started
            with contextlib.suppress(queue.Empty):
                rank, ok, payload = results.get(timeout=0.05)
                errors[rank] = None if ok else payload
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # also ends a stopped process
            p.join()
    with contextlib.suppress(queue.Empty):
        while True:
            rank, ok, payload = results.get(timeout=0.5)
            errors[rank] = None if ok else payload
    return {r: Survivor(errors.get(r), procs[r].exitcode if r in exited else None, exited.get(r)) for r in others}


class RankError(AssertionError):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
