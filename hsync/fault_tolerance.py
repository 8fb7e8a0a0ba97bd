"""Weighted steps that survive a lost replica, on torchft (`pip install hsync[torchft]`; `import hsync` never
imports this module). See Note [Failover].

    steps = FaultTolerantSteps(model, optimizer, len(dataset), hsync.BalanceConfig(global_batch_size=64),
                               FaultToleranceConfig(lighthouse="http://host:29510", replica_id="gpu0"))
    for epoch in range(steps.epoch, epochs):
        steps.set_epoch(epoch)
        while (stats := steps.step(lambda indices: loss_fn(*batch_of(indices)))) is not None:
            if stats.finite:  # a committed step: the gradient the whole cluster would have reduced
                optimizer.step()

Note [Failover]
~~~~~~~~~~~~~~~
Each replica group is one rank (one GPU, or one CPU process): torchft's model, in which a group is a job of its
own that may die and come back. torchft keeps the quorum (its Lighthouse), heals a joining replica from a live
peer (its checkpoint transport) and agrees on each step's commit (its Manager); hsync does the rest as for a job
that never fails: the weighted reduction, the Balancer's split, the deadline on every collective.

- The group. hsync's collectives run over a torch.distributed default group that is built anew for each quorum,
  on the quorum's own store prefix (torchft hands it to a process group's configure()), over the replicas in
  the quorum. So every part of hsync (the engine, its channels, the model check, the Balancer's settings
  check, the failure board) runs unchanged over the survivors; on a GPU the engine builds its own NCCL
  communicator per quorum, as it does per wrap (Note [NCCL bootstrap]). torchft's own process groups (a
  gloo or NCCL group reconfigured per quorum, used through manager.allreduce) would take over the reduction:
  averaging over participants, not weighting by examples, and without hsync's fused pack, deadlines and
  error naming.
- A step. Each attempt starts a quorum (synchronously: a healing replica has loaded its peer's state before
  it runs the step). If the quorum changed, the old group is destroyed, the new one built, the module wrapped
  anew and a new Balancer made from where the committed steps left off (the epoch's order, the step in it),
  so it splits *the same global batch* among the replicas there are now. A collective that fails (a replica
  died in its forward, its backward, the bucket reductions) fails on every survivor within the deadline;
  each reports it to torchft and does not commit, the gradients are dropped, the next quorum leaves the lost
  replica out and the step runs again. A step commits only once every replica's share of it was reduced,
  so a committed update is the cluster's exact weighted mean, whoever was there; a replica lost after that
  (in its optimizer step) is left out from the next step on. Every example of an epoch is used exactly once
  in committed steps.
- What is not exact across a redo: what the discarded attempt changed outside the gradients (BatchNorm's
  running statistics) and random draws that are not seeded by example (docs/failures.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hsync.balance import BalanceConfig, Balancer
from hsync.balance.balancer import SettingsDiffer
from hsync.collectives import Channels, resolve_timeout
from hsync.ddp import WeightedDDP
from hsync.sharding import ShardedOptimizer
from hsync.stats import StepStats

try:
    from torchft import Manager
    from torchft.process_group import ProcessGroup as _TorchftGroup
    from torchft.process_group import create_store_client
except ImportError as error:  # pragma: no cover - the extra is installed wherever this module is tested
    raise ImportError("hsync.fault_tolerance needs torchft: pip install hsync[torchft]") from error

log = logging.getLogger(__name__)

CHECK_ONLY = "HSYNC_CHECK_ONLY"
"""When this variable is 1, FaultTolerantSteps checks its settings and then ends the program (status 0), before it
joins a job. scripts/fault_tolerant_local.sh runs the program so once before it starts the groups, so that a
refused flag is one line, not one per group and per restart of torchrun."""

LIGHTHOUSE_PATIENCE = datetime.timedelta(seconds=5)
"""How long a replica waits for the Lighthouse to answer before it says that it is waiting (it waits up to the
deadline: groups may start before it)."""


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig:
    """How a replica finds the others, and how long it waits for them."""

    lighthouse: str | None = None
    """The torchft Lighthouse's address (http://host:port); default: the TORCHFT_LIGHTHOUSE variable."""
    replica_id: str | None = None
    """This replica group's name, unique among the groups (a restarted group may reuse it); default: the
    REPLICA_GROUP_ID variable, else host:pid."""
    min_replicas: int = 1
    """The fewest replicas a step may commit with: a quorum of fewer runs it, but does not commit it. When a quorum
    forms is the Lighthouse's --min_replicas (a majority of the groups, say): keep this at most that."""
    host: str = dataclasses.field(default_factory=socket.gethostname)
    """The name or address the other replicas reach this one by (its store, its checkpoint server)."""
    timeout: datetime.timedelta | None = None
    """The deadline of every collective and of torchft's commit and healing calls; default: HSYNC_TIMEOUT,
    else hsync.collectives.DEFAULT_TIMEOUT."""
    quorum_timeout: datetime.timedelta = datetime.timedelta(minutes=5)
    """How long a replica waits for a quorum (min_replicas of them) to form."""
    max_retries: int | None = 10
    """Attempts of one step in a row that may fail before this replica gives up with an error (None: no end)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.min_replicas, int) and self.min_replicas >= 1):
            raise ValueError(f"FaultToleranceConfig.min_replicas must be a positive integer, got {self.min_replicas!r}")
        if self.max_retries is not None and not (isinstance(self.max_retries, int) and self.max_retries >= 0):
            raise ValueError(f"FaultToleranceConfig.max_retries must be None or a non-negative integer, "
                             f"got {self.max_retries!r}")
        resolve_timeout(self.timeout)  # refuses a bad deadline here, not at the first step
        if self.quorum_timeout.total_seconds() <= 0:
            raise ValueError(f"FaultToleranceConfig.quorum_timeout must be positive, got {self.quorum_timeout}")


class _QuorumStore(_TorchftGroup):
    """What torchft's Manager takes for a process group: it keeps the store prefix, rank and size of each new
    quorum for FaultTolerantSteps, which builds hsync's group there (Note [Failover]). It runs no collective:
    hsync's reduce, torchft's manager.allreduce is not used."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.pending: tuple[str, int, int] | None = None  # (store address/prefix, rank, world size)
        self._size = 1

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        # Called on the Manager's quorum thread; read on the main thread after start_quorum() has returned.
        self.pending = (store_addr, rank, world_size)
        self._size = world_size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "hsync"


class FaultTolerantSteps:
    """Drives the steps of one replica group (this process) of a fault-tolerant job: each step's share of the
    global batch, planned by an hsync.Balancer over the replicas in the current quorum, and the weighted
    reduction, until torchft has agreed that every replica's share was reduced; the loop then steps its
    optimizer. A step in which a replica is lost is run again by the survivors, on the same examples (Note
    [Failover]).

    `module`: the model, not wrapped (each quorum wraps it in an hsync.WeightedDDP with `wrap_options`).
    `optimizer`: over its parameters. `examples`, `balance`: as hsync.Balancer's. `state`: the loop's other
    objects that change as it steps, by name, each with state_dict() and load_state_dict() (an LR scheduler, a
    GradScaler); an LR scheduler over `optimizer` must be among them (refused otherwise). A joining replica
    takes the module's, the optimizer's and these states, and where the loop is, from a live one (torchft's
    healing); state_dict() holds the same for the job's own checkpoints.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, examples: int | list[float],
                 balance: BalanceConfig, config: FaultToleranceConfig | None = None, *,
                 wrap_options: Mapping[str, Any] | None = None, state: Mapping[str, Any] | None = None) -> None:
        config = config or FaultToleranceConfig()
        self._state = dict(state or {})
        for name, part in self._state.items():
            if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
                raise ValueError(f"hsync.fault_tolerance: state[{name!r}] has no state_dict() and load_state_dict(): "
                                 f"a joining replica could not take it from a live one (got {type(part).__name__})")
        _refuse_an_unheld_scheduler(optimizer, self._state)
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise ValueError("hsync.fault_tolerance: each replica group is one rank (Note [Failover]); start each "
                             f"as a job of its own (torchrun --nproc_per_node 1), not {os.environ['WORLD_SIZE']} "
                             "ranks in one")
        if dist.is_initialized():
            raise RuntimeError("hsync.fault_tolerance builds the process group of each quorum itself: do not call "
                               "torch.distributed.init_process_group()")
        if isinstance(optimizer, ShardedOptimizer):
            raise ValueError("hsync.fault_tolerance: a ShardedOptimizer keeps each shard of the optimizer state on one "
                             "rank only, which a lost replica would take with it; use the plain optimizer")
        lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError("hsync.fault_tolerance: no Lighthouse: pass FaultToleranceConfig(lighthouse=...) or set "
                             "TORCHFT_LIGHTHOUSE")
        lighthouse_source = "FaultToleranceConfig.lighthouse" if config.lighthouse else "TORCHFT_LIGHTHOUSE"
        lighthouse_host, lighthouse_port = _lighthouse_endpoint(lighthouse, lighthouse_source)
        if os.environ.get(CHECK_ONLY) == "1":
            raise SystemExit(0)
        self.module, self.optimizer = module, optimizer
        self._examples, self._balance = examples, balance
        self._wrap_options = dict(wrap_options or {})
        self._timeout = datetime.timedelta(seconds=resolve_timeout(config.timeout))
        self._quorum_timeout = config.quorum_timeout
        self._wrap_options.setdefault("timeout", self._timeout)
        # Where the loop is, as of the last committed step: what a new Balancer starts from.
        self._position: dict | None = None
        self._epoch = 0
        self.model: WeightedDDP | None = None
        self.balancer: Balancer | None = None
        self.examples_in_step: list[int] = []
        """This replica's examples in the step being run (or last run)."""
        self._in_job = False  # whether this replica committed a step or resumed the job: a joining one did neither
        self._quorum = _QuorumStore()
        self._store = dist.TCPStore(config.host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout)
        replica_id = config.replica_id or os.environ.get("REPLICA_GROUP_ID") or f"{config.host}:{os.getpid()}"
        self._replica_id = replica_id
        self._lighthouse = (lighthouse_host, lighthouse_port, f"{lighthouse} ({lighthouse_source})")
        _wait_for_lighthouse(*self._lighthouse, replica_id, self._timeout)
        self.manager = Manager(
            pg=self._quorum, load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=config.min_replicas, use_async_quorum=False, timeout=self._timeout,
            quorum_timeout=config.quorum_timeout, connect_timeout=self._timeout, rank=0, world_size=1,
            store_addr=config.host, store_port=self._store.port, lighthouse_addr=lighthouse,
            replica_id=replica_id, hostname=config.host, max_retries=config.max_retries)

    # -- the loop's side -----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the committed steps have reached (after a healing, the peer's)."""
        return self._position["epoch"] if self._position is not None else self._epoch

    @property
    def global_step(self) -> int:
        """Steps committed, over all epochs."""
        return self._position["global_step"] if self._position is not None else 0

    def set_epoch(self, epoch: int) -> None:
        """Runs the steps of `epoch` next (each epoch has its own order), or goes on inside it. An epoch the job
        has passed (a replica that joined late learns where the others are at its first step) has no steps
        left here: step() returns None at once."""
        self._epoch = epoch
        if self._position is not None and self._position["epoch"] < epoch:
            self._position = {**self._position, "epoch": epoch, "step_in_epoch": 0}

    def step(self, loss_of: Callable[[list[int]], Any]) -> StepStats | None:
        """Runs the epoch's next step until it commits, and returns its StepStats (None once the epoch is done).
        `loss_of(indices)` runs the model on these examples of the dataset and returns the loss (their mean),
        or (loss, weight, metrics) as Balancer.forward_backward's; it may be called again for the same
        examples when a replica is lost. The gradients are zeroed here, before each attempt; once it returns,
        they are the step's exact weighted mean on every replica: step the optimizer (when stats.finite) before
        the next call, as after any backward (clip, schedule, scale as usual)."""
        _refuse_an_unheld_scheduler(self.optimizer, self._state)  # one built since the constructor
        while True:
            # Decided before the quorum: a replica in it runs its step, whatever epoch its loop is in (one that
            # joined late runs the job's step, of a later epoch, and its loop catches up at the next call).
            if self._position is not None and self._position["epoch"] > self._epoch:
                return None
            self.optimizer.zero_grad(set_to_none=True)
            try:
                self.manager.start_quorum()
            except TimeoutError as error:  # torchft's says only "Timeout expired"
                host, port, name = self._lighthouse
                if (refused := _unanswered(host, port, 5.0)) is None:
                    why = ("fewer replica groups than the Lighthouse's --min_replicas have joined (one lost before its "
                           "first step, or not started yet)")
                else:
                    why = (f"the Lighthouse at {name} does not answer ({refused}): the job cannot go on without it; "
                           "start it again from the job's checkpoint (FaultTolerantSteps.state_dict())")
                raise TimeoutError(
                    f"hsync.fault_tolerance: replica {self._replica_id}: no quorum formed within the quorum timeout of "
                    f"{self._quorum_timeout.total_seconds():g} s (FaultToleranceConfig.quorum_timeout): {why}. "
                    f"torchft: {error}") from None
            stats, lost = None, None
            try:
                if self._quorum.pending is not None or self.balancer is None:
                    self._regroup()
                stats = self._run_step(loss_of)
            except Exception as error:  # noqa: BLE001 - re-raised unless a peer was lost
                if isinstance(error, _Refused):  # this replica alone: its peers go on without it, told at once
                    self.manager.report_error(error)
                    self.manager.should_commit()
                    raise
                if not self._lost_a_peer(error):
                    raise
                self.manager.report_error(error)
                lost = error
            if self.manager.should_commit():
                self._position = self.balancer.state_dict()
                self._in_job = True
                return stats
            # Not committed: the next attempt starts from the last committed position, in a new quorum.
            log.warning("hsync: replica %s: step %d not committed, running it again: %s", self._replica_id,
                        self.global_step, lost or "too few replicas in the quorum")
            self._drop_group()

    def state_dict(self) -> dict[str, Any]:
        """The job's state for a checkpoint of its own (torchft heals from live replicas only, so a job restarted
        whole starts from one): the module's, the optimizer's and `state`'s, where the committed steps have
        reached, and torchft's count of them. Every replica holds the same after a committed step."""
        return {**self._state_dict(), "torchft": self.manager.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes the job from a checkpoint written by state_dict(), before the first step. A replica that starts
        without it takes it from one that loaded it, as from any live replica."""
        if self.balancer is not None or self._in_job:
            raise RuntimeError("hsync.fault_tolerance: load_state_dict() resumes a job: call it before the first step")
        self._load_state_dict(state)
        self.manager.load_state_dict(state["torchft"])
        self._in_job = True

    def close(self) -> None:
        """Leaves the job: the process group, torchft's manager and this replica's store."""
        self._drop_group()
        self.manager.shutdown(wait=False)

    def __enter__(self) -> FaultTolerantSteps:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- inside a step ---------------------------------------------------------------------------------

    def _run_step(self, loss_of: Callable[[list[int]], Any]) -> StepStats:
        micro_batches = next(self.balancer.steps())  # there is one: the position is inside an epoch
        self.examples_in_step = [] if self.balancer.filler else [i for m in micro_batches for i in m]
        stats = None
        for indices in micro_batches:
            stats = self.balancer.forward_backward(indices, loss_of)
        # On a GPU the step's reductions may still be running: one that a lost replica failed is raised where
        # the step's flag is read (it waits for them), so it is read here, before torchft decides to commit.
        stats.finite  # noqa: B018
        return stats

    def _regroup(self) -> None:
        """hsync's group over the replicas of the new quorum, the module wrapped there, and a Balancer from the
        last committed position."""
        self._drop_group()
        if self._quorum.pending is None:  # torchft moves to a new quorum after a step that did not commit
            raise RuntimeError("hsync.fault_tolerance: torchft kept the quorum of a step that did not commit, so "
                               "there is no store prefix to build a new group on")
        store_address, rank, world_size = self._quorum.pending
        self._quorum.pending = None
        try:  # gloo for hsync's channels; on a GPU the engine builds its own NCCL communicator over the store
            dist.init_process_group("gloo", store=create_store_client(store_address, self._timeout), rank=rank,
                                    world_size=world_size, timeout=self._timeout)
        except (RuntimeError, TimeoutError) as error:  # a replica of the quorum is gone already
            raise _RegroupFailed(f"hsync: building the group of the new quorum (rank {rank} of {world_size}) "
                                 f"failed: {error}") from error
        self.model = WeightedDDP(self.module, **self._wrap_options)
        try:
            self.balancer = Balancer(self.model, self._examples, self._balance)
        except SettingsDiffer as error:
            raise self._joining_replicas_refused(error) from None
        if self._position is not None:
            self.balancer.load_state_dict(self._position)
        else:
            self.balancer.set_epoch(self._epoch)

    def _joining_replicas_refused(self, error: SettingsDiffer) -> Exception:
        """Where the replicas running the job (they committed steps, or resumed it) agree, a joining one given other
        data or settings is refused alone, and the others run the step again without it; at the job's start,
        every replica refuses the difference, as a Balancer does."""
        in_job = Channels.of_model(self.model).gather_objects(self._in_job, "which replicas run the job")
        job = next((rank for rank, yes in enumerate(in_job) if yes), None)
        if job is None:
            return error
        odd = [rank for rank, theirs in enumerate(error.settings) if theirs != error.settings[job]]
        difference = SettingsDiffer.describe(error.settings, job, odd[0])
        if dist.get_rank() in odd:
            return _Refused(f"hsync.fault_tolerance: replica {self._replica_id} cannot join the job: its Balancer was "
                            f"given other data or settings than the replicas running it: {difference}")
        return _RegroupFailed(f"hsync.fault_tolerance: the joining replicas at ranks {odd} of the new quorum were "
                              f"refused, given other data or settings than this job's ({difference}); the step runs "
                              "again without them")

    def _drop_group(self) -> None:
        if self.model is not None:
            self.model._retire()  # which lets go of the Balancer too: no cycle is left for a collection to free
        self.model = self.balancer = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _lost_a_peer(self, error: Exception) -> bool:
        """Whether `error` is a lost replica's (a collective that failed), not this replica's own."""
        if isinstance(error, _RegroupFailed):
            return True
        return dist.is_initialized() and Channels.failed(dist.group.WORLD)

    # -- healing (torchft calls these) ---------------------------------------------------------------

    def _state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "position": self._position, "state": {name: part.state_dict() for name, part in self._state.items()}}

    def _load_state_dict(self, state: Mapping[str, Any]) -> None:
        parts = state.get("state", {})
        if set(parts) != set(self._state):
            raise _Refused(f"hsync.fault_tolerance: replica {self._replica_id} holds state {sorted(self._state)}, the "
                           f"state it was given holds {sorted(parts)}: pass the same state= to every replica")
        try:
            self.module.load_state_dict(state["module"])
            self.optimizer.load_state_dict(state["optimizer"])
            for name, part in self._state.items():
                part.load_state_dict(parts[name])
        except (RuntimeError, ValueError, KeyError) as error:  # another model's, say: torch's says which tensors
            raise _Refused(f"hsync.fault_tolerance: replica {self._replica_id} cannot take the state it was given "
                           f"(another model or optimizer than the job's?): {' '.join(str(error).split())}") from None
        self._position = state["position"]


def _lighthouse_endpoint(address: str, source: str) -> tuple[str, int]:
    """The host and port of the Lighthouse at `address`, which must be an http(s) URL: torchft's client takes any
    other text for an address that does not answer, and says so only at the deadline."""
    url = urllib.parse.urlsplit(address)
    try:
        port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    except ValueError:  # a port that is not a number from 0 to 65535
        port = None
    if url.scheme not in ("http", "https") or not url.hostname or not port:
        raise ValueError(f"hsync.fault_tolerance: {source} must be the Lighthouse's address, http://host:port, "
                         f"got {address!r}")
    return url.hostname, port


def _wait_for_lighthouse(host: str, port: int, name: str, replica_id: str, timeout: datetime.timedelta) -> None:
    """Returns once the Lighthouse accepts a connection; says after LIGHTHOUSE_PATIENCE that this replica waits for
    it, and fails at the deadline naming it (torchft's client would wait as long in silence)."""
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    said_so = False
    while True:
        if (problem := _unanswered(host, port, max(0.1, min(5.0, deadline - time.monotonic())))) is None:
            return
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"hsync.fault_tolerance: replica {replica_id}: no Lighthouse answered at {name} within "
                               f"the deadline of {timeout.total_seconds():g} s: {problem}")
        if not said_so and now - start >= LIGHTHOUSE_PATIENCE.total_seconds():
            log.warning("hsync: replica %s: waiting for the Lighthouse at %s (%s); giving up after %g s", replica_id,
                        name, problem, timeout.total_seconds())
            said_so = True
        time.sleep(min(0.2, deadline - now))


def _unanswered(host: str, port: int, timeout_s: float) -> OSError | None:
    """Why nothing accepts a connection at host:port within `timeout_s` (None: something does)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        return error
    return None


def lighthouse_command(port: int, min_replicas: int, *, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 2000,
                       quorum_tick_ms: int = 50) -> list[str]:
    """The command that starts torchft's Lighthouse on `port`: its console script, run by this Python, found next
    to it or, in a --target install, next to the torchft package. A dead group is seen at its next collective;
    its heartbeat stops counting after `heartbeat_timeout_ms`, and a quorum waits up to `join_timeout_ms` for
    groups that heartbeat but have not asked to join."""
    import torchft

    candidates = [Path(sys.executable).parent, Path(torchft.__file__).parents[1] / "bin"]
    script = next((str(folder / "torchft_lighthouse") for folder in candidates
                   if (folder / "torchft_lighthouse").is_file()), None)
    if script is None:
        raise FileNotFoundError(f"torchft's torchft_lighthouse script is in none of {[str(c) for c in candidates]}")
    return [sys.executable, script, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
            "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
            "--quorum_tick_ms", str(quorum_tick_ms)]


class _RegroupFailed(RuntimeError):
    """The group of a new quorum could not be built: a replica of it is gone, or was refused."""


class _Refused(ValueError):
    """This replica cannot take part in the job (its settings, or the state it was healed with, are another job's)."""


def _refuse_an_unheld_scheduler(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """An LR scheduler over `optimizer` that is not in `state` would restart its schedule on each replica that
    joins, which would then step with another learning rate than its peers: silently different parameters."""
    # torch's LR schedulers mark the optimizer's step they wrap (to warn of a step out of order).
    if hasattr(optimizer.step, "_wrapped_by_lr_sched") and not any(
            getattr(part, "optimizer", None) is optimizer for part in state.values()):
        raise ValueError("hsync.fault_tolerance: an LR scheduler steps this optimizer, but is not in "
                         "FaultTolerantSteps(state=...): a replica that joins would start its schedule over (pass "
                         "state={'schedule': scheduler})")
