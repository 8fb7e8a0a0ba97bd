"""hsync's collectives besides the gradient reduction: the model check at wrap time, Join's, sum_over_ranks,
the applications' decisions. Each goes through a communicator of hsync's, with a deadline and a failure board
as the engine's has (Note [Failing fast] in csrc/comm/fault_monitor.h): a peer that froze or died ends it
with an error naming the collective and the rank, never a hang. None is written with torch.distributed's
collectives, which wait for their process group's own timeout (30 minutes by default) instead.

    channel = Channels.of_group(group)          # or Channels.of_model(model): the engine's communicator
    totals = channel.all_reduce_sum(torch.tensor([correct, count]), "the evaluation's totals")
"""

from __future__ import annotations

import collections
import datetime
import math
import os
import pickle
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hsync._extension import _C
from hsync.errors import describe

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""Collective deadline unless WeightedDDP(timeout=...) or HSYNC_TIMEOUT (seconds) says otherwise: longer
than any sane step or checkpoint write, half of torch's NCCL default, and a dead peer is usually seen
far sooner (its sockets close, or a peer posts the failure)."""

_MAX_TIMEOUT = datetime.timedelta(days=365)  # the engine's clocks count nanoseconds in 64 bits

# What a forward's broadcast of rank 0's buffers carries, as errors name it. One without gradients that a peer
# never joins (an evaluation run on one rank alone, after a training step) is the likeliest way to leave it
# waiting: the label says what to do instead.
BUFFERS_BEFORE_A_FORWARD = "the buffers before a forward"
BUFFERS_BEFORE_A_FORWARD_WITHOUT_GRADIENTS = (
    "the buffers before a forward without gradients (one that follows a synchronised forward takes rank 0's "
    "buffers, as DDP's does: to evaluate on some ranks only, run model.module there)")

# Per group name, how many channels were built over it: with the name, names a channel's store keys. Every
# rank of a group builds its channels in the same order (each build is collective).
_channels_built: collections.defaultdict[str, int] = collections.defaultdict(int)
# Per group, its channels by device type and deadline: built once, used by every later call.
_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_ended_groups: list[dist.ProcessGroup] = []


def end_process_group() -> None:
    """torch.distributed.destroy_process_group(), for a process about to exit after a run that succeeded,
    keeping the default group's object until it does. A communication hook's future callbacks (torch's
    PowerSGD hook's) hold the group, and the gloo thread that completed the future releases them just after
    the step has ended; were that release the group's last, its destructor would join the very thread it
    runs on and the process would abort ("Resource deadlock avoided"). torch DDP's programs are exposed
    alike. After a failure, destroy_process_group() itself is the one to call: the group's destructor then
    waits for gloo's threads (until gloo's own deadline), and a store this rank hosts stays up meanwhile, so
    the peers still read the failure posted there (Note [Failing fast])."""
    group = dist.group.WORLD
    if group is not None:
        _ended_groups.append(group)
    dist.destroy_process_group()


def put_torch_groups_under_the_deadline(groups: Iterable[dist.ProcessGroup | None],
                                        timeout: datetime.timedelta | None = None) -> None:
    """Bounds torch's own collectives on `groups` (a framework's, torch DDP's beside hsync in the benchmark): each
    backend whose timeout is longer (torch's default: 30 minutes) takes hsync's deadline (`timeout`, else
    HSYNC_TIMEOUT, else DEFAULT_TIMEOUT) plus the grace hsync's own collectives give gloo. On CPU they share the
    group's connections, so a stuck collective of hsync's is still reported as hsync's, naming it; a frozen peer
    in one of torch's ends in gloo's timeout error. On NCCL it is the watchdog's limit, past which it aborts the
    process. A shorter timeout, set by the user, stays."""
    deadline = datetime.timedelta(seconds=resolve_timeout(timeout) + _C.backend_grace_s)
    for group in set(groups) - {None}:
        for device in group._device_types:
            backend = group._get_backend(device)
            if _timeout_of(backend) > deadline:
                backend.set_timeout(deadline)


def _timeout_of(backend: dist.Backend) -> datetime.timedelta:
    # A backend that does not say (a third party's) is taken for one with torch's default, 30 minutes or more.
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta.max


def resolve_timeout(timeout: datetime.timedelta | None) -> float:
    """The collective deadline in seconds, from the argument, else HSYNC_TIMEOUT, else DEFAULT_TIMEOUT."""
    if timeout is None:
        text = os.environ.get("HSYNC_TIMEOUT")
        try:
            seconds = float(text) if text else DEFAULT_TIMEOUT.total_seconds()
        except ValueError:
            raise ValueError(f"HSYNC_TIMEOUT must be a number of seconds, got {text!r}") from None
    elif isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        raise TypeError(f"timeout must be a datetime.timedelta, got {describe(timeout)}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"the collective timeout must be positive and finite, got {seconds} s")
    if seconds > _MAX_TIMEOUT.total_seconds():
        raise ValueError(f"the collective timeout must be at most {_MAX_TIMEOUT.days} days, got {seconds} s")
    return seconds


def make_comm(group: dist.ProcessGroup, device: torch.device, timeout_s: float, key: str):
    """A communicator of hsync's (an engine's or a channel's): NCCL of our own on GPU (Note [NCCL bootstrap]),
    the process group on CPU. `key`: the same on every rank of the group, and used by no other communicator."""
    # Keys unique to this communicator and this attempt: torchrun may restart workers on the same store.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hsync/{attempt}/{key}"
    store = dist.distributed_c10d._get_default_store()
    debug = os.environ.get("HSYNC_DEBUG_COLLECTIVES", "0") not in ("", "0")
    faults = _C.FaultOptions(store, f"{prefix}/failure", timeout_s, debug)
    if device.type != "cuda":
        return _C.ProcessGroupComm(group, faults)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        store.set(f"{prefix}/nccl-id", _C.nccl_unique_id())
    return _C.NcclComm(bytes(store.get(f"{prefix}/nccl-id")), rank, world_size, device.index, faults)


@dataclass(frozen=True)
class Channel:
    """A communicator of hsync's and the device its tensors live on. Every method is a collective: every rank
    of the group calls it, in the same order, with tensors of the same shape and dtype."""

    comm: _C.Communicator
    device: torch.device

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def all_reduce_sum(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """The sum over ranks of `tensor`, on the host; `label` names the collective in errors."""
        on_device = self.all_reduce_sum_on_device(tensor, label)
        # On a GPU the copy waits for the collective on the device; a failure meanwhile leaves garbage there
        # (hsync's NCCL watchdog aborts a stuck collective at the deadline), which check() reports.
        host = on_device.cpu()
        self.comm.check()
        return host

    def all_reduce_sum_on_device(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """The sum over ranks of `tensor`, on the channel's device: on a GPU the current stream waits for it, not
        the host, and a failure meanwhile (its values are then garbage) is raised at the next collective."""
        on_device = tensor.detach().to(self.device, copy=True).contiguous()
        self.comm.all_reduce_sum(on_device, label)
        self.comm.synchronize()
        return on_device

    def max_over_ranks(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """The elementwise maximum over ranks of `tensor`, on the host (a gather: the sum is all they reduce)."""
        return self.gather(tensor.detach().cpu(), label).amax(0)

    def barrier(self, label: str) -> None:
        """Returns once every rank has reached it."""
        self.all_reduce_sum(torch.zeros(1), label)

    def gather(self, row: torch.Tensor, label: str) -> torch.Tensor:
        """Every rank's `row`, stacked in rank order: one all-reduce of a table in which each rank fills its own."""
        table = torch.zeros((self.world_size, *row.shape), dtype=row.dtype)
        table[self.rank] = row
        return self.all_reduce_sum(table, label)

    def gather_objects(self, obj: object, label: str) -> list:
        """Every rank's picklable `obj`, in rank order."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.gather(torch.tensor([payload.numel()], dtype=torch.int64), f"{label} (sizes)")[:, 0].tolist()
        row = torch.zeros(max(sizes), dtype=torch.uint8)
        row[:payload.numel()] = payload
        table = self.gather(row, label)
        return [pickle.loads(table[r, :size].numpy().tobytes()) for r, size in enumerate(sizes)]

    def broadcast_object(self, obj: object, root: int, label: str) -> object:
        """`root`'s picklable `obj` on every rank (what the others pass is not sent)."""
        return self.gather_objects(obj if self.rank == root else None, label)[root]


class Channels:
    """Where hsync's own collectives go."""

    @staticmethod
    def of_group(group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 timeout_s: float | None = None) -> Channel:
        """A channel over `group` (default: the world), built on its first use on every rank of the group. Its
        tensors live on the CPU where the group has gloo, else on `device` (default: the current GPU). Its
        deadline: `timeout_s`, else HSYNC_TIMEOUT, else DEFAULT_TIMEOUT."""
        group = group or dist.group.WORLD
        if group is None:
            raise RuntimeError("hsync needs torch.distributed.init_process_group() first")
        # "cpu:gloo,cuda:nccl" for init_process_group() without a backend, whose get_backend() is 'undefined'.
        backend = dist.get_backend_config(group)
        if "gloo" in backend:
            device = torch.device("cpu")
        elif not torch.cuda.is_available():
            raise RuntimeError(f"hsync: the process group's backend is {backend!r}, and on a machine without a GPU "
                               "hsync needs gloo: init_process_group('gloo') (Accelerate: Accelerator(cpu=True), or "
                               "accelerate launch --cpu)")
        elif device is None or device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        timeout_s = resolve_timeout(None) if timeout_s is None else timeout_s
        built = _channels.setdefault(group, {})
        key = (device.type, timeout_s)
        if key not in built:
            name = dist.distributed_c10d._get_process_group_name(group)
            index = _channels_built[name]
            _channels_built[name] = index + 1
            built[key] = Channel(make_comm(group, device, timeout_s, f"{name}/channel/{index}"), device)
        return built[key]

    @staticmethod
    def failed(group: dist.ProcessGroup | None = None) -> bool:
        """Whether a collective of hsync's failed here or on a peer since `group` (default: the world) was built,
        as its channels know: a failure on any communicator of this process reaches them all (Note [Failing
        fast]), so this tells a lost peer from an error of this rank's own. Builds nothing; False before the
        group's first channel (a WeightedDDP's wrap builds one)."""
        for channel in _channels.get(group or dist.group.WORLD, {}).values():
            try:
                channel.comm.check()
            except RuntimeError:
                return True
        return False

    @staticmethod
    def of_model(model) -> Channel:
        """The channel of a WeightedDDP's engine: its collectives keep their order with the engine's."""
        return Channel(model._ensure_engine().comm, model.device)
