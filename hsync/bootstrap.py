"""What wrapping a model takes across its ranks: the check that every rank wraps the same model with the
same settings, the collective deadline, and the engine's communicator."""

from __future__ import annotations

import collections
import contextlib
import datetime
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from hsync._extension import _C
from hsync.compat import ignored_names, reduced_parameters
from hsync.errors import describe

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""Collective deadline unless WeightedDDP(timeout=...) or HSYNC_TIMEOUT (seconds) says otherwise: longer
than any sane step or checkpoint write, half of torch's NCCL default, and a dead peer is usually seen
far sooner (its sockets close, or a peer posts the failure)."""

_MAX_TIMEOUT = datetime.timedelta(days=365)  # the engine's clocks count nanoseconds in 64 bits
# Per group, the index of the next engine built over it: with the group's name, names an engine's store
# keys. The ranks agree on it as they build one (the largest any proposes), so a rank outside a group,
# which skips that group's engines, or a process that replaced a failed one, uses the same keys.
_engines_built: collections.defaultdict[str, int] = collections.defaultdict(int)


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


def make_comm(group: dist.ProcessGroup, device: torch.device, timeout_s: float, engine_key: str):
    """The engine's communicator: NCCL of our own on GPU (Note [NCCL bootstrap]), the process group on CPU.
    `engine_key`: the same on every rank of the group, and used by no other engine over it."""
    # Keys unique to this engine and this attempt: torchrun may restart workers on the same store.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hsync/{attempt}/{engine_key}"
    store = dist.distributed_c10d._get_default_store()
    debug = os.environ.get("HSYNC_DEBUG_COLLECTIVES", "0") not in ("", "0")
    faults = _C.FaultOptions(store, f"{prefix}/failure", timeout_s, debug)
    if device.type != "cuda":
        return _C.ProcessGroupComm(group, faults)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        store.set(f"{prefix}/nccl-id", _C.nccl_unique_id())
    return _C.NcclComm(bytes(store.get(f"{prefix}/nccl-id")), rank, world_size, device.index, faults)


def _model_signature(module: nn.Module) -> tuple[list[tuple], list[str]]:
    """What must match across ranks, and this rank's problems that no rank could work with."""
    ignored = ignored_names(module)
    signature = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
                 for name, p in reduced_parameters(module, named=True)]
    signature += [("buffer", name, tuple(b.shape), str(b.dtype), False)
                  for name, b in module.named_buffers() if name not in ignored]
    problems = []
    devices = sorted({str(p.device) for p in reduced_parameters(module)})
    if len(devices) > 1:
        problems.append(f"parameters on several devices ({', '.join(devices)}); wrap a single-device module")
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.sparse:
            problems.append(f"'{name}' produces sparse gradients (sparse=True); hsync reduces dense gradients only")
    for name, p in reduced_parameters(module, named=True):
        if hasattr(p, "_in_backward_optimizers"):
            # Its optimizer would step on the local gradient, before any reduction: ranks would drift apart.
            problems.append(f"parameter '{name}' has an optimizer applied in backward (torch's "
                            "_apply_optimizer_in_backward), which hsync does not run; step the optimizer "
                            "after backward")
            break
    return signature, problems


def engine_key(group: dist.ProcessGroup, device: torch.device, module: nn.Module, settings: dict[str, object],
               refusal: Exception | None) -> str:
    """Checks the model across the group's ranks (verify_same_model); returns the key of the new engine's
    store entries: the same on every rank of the group, and used by no other engine over it."""
    name = dist.distributed_c10d._get_process_group_name(group)
    index = verify_same_model(group, device, module, settings, refusal, _engines_built[name])
    _engines_built[name] = index + 1
    return f"{name}/{index}"


def gather_objects(obj: object, group: dist.ProcessGroup | None, device: torch.device) -> list:
    """dist.all_gather_object with `device` as the current CUDA device, where NCCL carries it: torch's
    uses the current one, cuda:0 on every rank of a program that never called torch.cuda.set_device
    (as DDP's users need not), which NCCL refuses as one GPU used twice."""
    gathered: list = [None] * dist.get_world_size(group)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def verify_same_model(group: dist.ProcessGroup, device: torch.device, module: nn.Module,
                       settings: dict[str, object], refusal: Exception | None, engine_index: int) -> int:
    """Raises the same error on every rank if a rank refused (its `refusal`, naming the rank), the ranks'
    models or `settings` differ (RuntimeError, as DDP's) or one cannot be wrapped (ValueError); else
    returns the engine index the ranks agree on (the largest `engine_index` proposed)."""
    gathered = gather_objects((*_model_signature(module), settings, refusal, engine_index), group, device)
    for rank, (*_, theirs, _) in enumerate(gathered):
        if theirs is not None:
            raise type(theirs)(f"{theirs} (on rank {rank})")
    for rank, (_, problems, *_) in enumerate(gathered):
        if problems:
            raise ValueError(f"hsync: cannot wrap the model: on rank {rank}, {problems[0]}")
    for rank, (_, _, theirs, *_) in enumerate(gathered[1:], start=1):
        for name, value in gathered[0][2].items():
            if theirs[name] != value:
                raise RuntimeError(f"hsync.WeightedDDP: {name} differs across ranks: {value} on rank 0, "
                                   f"{theirs[name]} on rank {rank}")
    reference = gathered[0][0]
    for rank, (signature, *_) in enumerate(gathered[1:], start=1):
        difference = _first_difference(reference, signature, rank)
        if difference:
            raise RuntimeError(f"hsync: the model differs across ranks: {difference}")
    return max(proposed for *_, proposed in gathered)


def _first_difference(reference: list[tuple], other: list[tuple], rank: int) -> str | None:
    def show(entry: tuple) -> str:
        kind, name, shape, dtype, requires_grad = entry
        frozen = "" if requires_grad or kind == "buffer" else ", frozen"
        return f"{kind} '{name}' of shape {list(shape)}, {dtype}{frozen}"

    for index, (mine, theirs) in enumerate(zip(reference, other, strict=False)):
        if mine != theirs:
            return f"entry #{index}: rank 0 has {show(mine)}, rank {rank} has {show(theirs)}"
    if len(reference) != len(other):
        longer, which = (reference, 0) if len(reference) > len(other) else (other, rank)
        return (f"rank 0 has {len(reference)} parameters and buffers, rank {rank} has {len(other)} "
                f"(first extra on rank {which}: {show(longer[min(len(reference), len(other))])})")
    return None
