"""WeightedDDP: a drop-in replacement for DistributedDataParallel with instance-weighted gradients.

The hot path (gradient hooks, bucketing, scaling, all-reduce) lives in hsync._C; this file
wires a module to it and turns `backward(loss, weight)` into the engine's per-step scalars.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import numbers
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hsync._extension import _C
from hsync.stats import (
    BAD_KIND_SUM,
    BAD_RANK_SUM,
    BAD_RANKS,
    LOSS_NONFINITE,
    LOSS_SUM,
    NUM_SLOTS,
    WEIGHT,
    BadInput,
    StepStats,
)

_MIB = 1024 * 1024
_MAX_TIMEOUT = datetime.timedelta(days=365)  # the engine's clocks count nanoseconds in 64 bits
_instances = itertools.count()  # same sequence on every rank: names this wrapper's store keys

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""Collective deadline unless WeightedDDP(timeout=...) or HSYNC_TIMEOUT (seconds) says otherwise: longer
than any sane step or checkpoint write, half of torch's NCCL default, and a dead peer is usually seen
far sooner (its sockets close, or a peer posts the failure)."""


@dataclass
class _Window:
    """What the micro-steps of one accumulation window (no_sync ... synced step) add up to."""

    local: torch.Tensor
    """This rank's step scalars, slot layout of hsync.stats (float64 on the model's device)."""
    ref: torch.Tensor
    """The weight local gradients are expressed in: the first non-zero weight of the window."""
    out_of_range: torch.Tensor
    """How many weights of the window were negative, NaN or infinite (checked on the device)."""
    problem: str | None = None
    """This rank's first bad input found on the host, raised on every rank at the synced step."""
    problem_kind: BadInput | None = None


class WeightedDDP(nn.Module):
    """Wraps `module` for data-parallel training in which each rank may hold a different number of examples.

    `loss.backward()` gives torch DDP's result (gradients averaged over ranks with equal weights).
    `model.backward(loss, weight=n)` gives the exact gradient of the global weighted mean:
    sum_r n_r g_r / sum_r n_r, and returns the step's global StepStats.

    Args:
        module: the model; every rank must pass the same architecture (checked at wrap time).
        process_group: the group to reduce over (default: the default group).
        bucket_cap_mb: bucket size cap in MiB, as DDP's.
        first_bucket_cap_mb: cap of the first bucket, kept small so communication starts early.
        broadcast_buffers: broadcast rank 0's buffers before each synchronised forward, as DDP does.
        gradient_as_bucket_view: as DDP's: each parameter's .grad becomes a view into its bucket, which
            saves a copy of every gradient in memory and the copy back after each reduction. The next
            reduction rewrites .grad in place, so clone it to keep it past the next step.
        metric_names: names of the extra sums that backward(..., metrics={...}) may report.
        timeout: how long any one collective may take before this rank gives up with an error naming it
            (default: HSYNC_TIMEOUT seconds, else DEFAULT_TIMEOUT). It spans the skew between ranks,
            so it must exceed the longest time one rank may run ahead of another.

    Set HSYNC_DEBUG_COLLECTIVES=1 to compare every collective across ranks before it runs ("collective
    mismatch: ..." instead of a hang when ranks make different calls); it slows every step.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = _C.default_bucket_bytes_cap / _MIB,
        first_bucket_cap_mb: float = _C.default_first_bucket_bytes_cap / _MIB,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        metric_names: tuple[str, ...] = (),
        timeout: datetime.timedelta | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("hsync.WeightedDDP needs torch.distributed.init_process_group() first")
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError(f"bucket caps must be positive, got {bucket_cap_mb} and {first_bucket_cap_mb} MiB")
        self.module = module
        group = process_group or dist.group.WORLD
        # Weakly, like the engine: destroy_process_group() must be able to free the group (and join
        # its threads) while the model lives on; a group freed at interpreter exit aborts it.
        self._group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.metric_names = tuple(metric_names)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        _verify_same_model(group, module)
        self.device = named[0][1].device if named else torch.device("cpu")
        self._buffers_to_sync = [b for b in module.buffers() if b.numel() > 0] if broadcast_buffers else []
        self._engine = _C.Engine(
            [p for _, p in named],
            [name for name, _ in named],
            _make_comm(group, self.device, _resolve_timeout(timeout)),
            int(bucket_cap_mb * _MIB),
            int(first_bucket_cap_mb * _MIB),
            gradient_as_bucket_view,
        )
        # Like DDP: every rank starts from rank 0's parameters and buffers.
        state = itertools.chain(module.parameters(), module.buffers())
        self._engine.broadcast_coalesced([t.detach() for t in state], 0)
        self._syncing = True
        self._window: _Window | None = None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduced over (None once it was destroyed)."""
        return self._group()

    def forward(self, *args, **kwargs):
        # Not under no_grad: evaluating on one rank alone must not start a collective.
        if self._syncing and self._buffers_to_sync and torch.is_grad_enabled():
            self._engine.broadcast_coalesced(self._buffers_to_sync, 0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronised backward reduces them all."""
        previous = self._syncing
        self._syncing = False
        self._engine.set_sync(False)
        try:
            yield
        finally:
            self._syncing = previous
            self._engine.set_sync(previous)

    def backward(
        self,
        loss: torch.Tensor,
        weight: float | torch.Tensor,
        metrics: Mapping[str, float | torch.Tensor] | None = None,
    ) -> StepStats | None:
        """Backpropagates the local mean `loss` over `weight` examples (or tokens).

        Synchronised: gradients become sum_r n_r g_r / sum_r n_r over every rank and micro-step of
        the window, and the step's StepStats is returned. Under no_sync: accumulates and returns None.
        A bad input on any rank raises ValueError on every rank at the synchronised step.
        """
        window = self._window or self._new_window()
        self._window = window
        w = self._add_micro_step(window, loss, weight, metrics or {})
        if not self._syncing:
            if w is not None and loss.requires_grad:
                self._backprop(loss, w, window.ref)
            return None

        self._window = None
        scalars = window.local
        if window.problem is not None:
            scalars[BAD_RANKS] = 1
            scalars[BAD_KIND_SUM] = int(window.problem_kind)
        else:
            scalars[BAD_RANKS] = (window.out_of_range > 0).to(torch.float64)
            scalars[BAD_KIND_SUM] = scalars[BAD_RANKS] * int(BadInput.WEIGHT_OUT_OF_RANGE)
        scalars[BAD_RANK_SUM] = scalars[BAD_RANKS] * (self.rank + 1)

        self._engine.begin_weighted_step(scalars, window.ref)
        try:
            if w is not None and loss.requires_grad:
                self._backprop(loss, w, window.ref)
        finally:
            # Also after a failed backward (out of memory, say): this rank still completes the
            # step's collectives, so its peers are not left waiting.
            self._engine.finalize_if_pending()
        host = self._engine.step_scalars()
        if host[BAD_RANKS] > 0:
            raise ValueError(_bad_input_message(host, window.problem, self.rank))
        return StepStats(host, self._engine.last_grad_nonfinite(), self.metric_names, self._engine.check)

    def _new_window(self) -> _Window:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=self.device)

        return _Window(local=zeros(NUM_SLOTS + len(self.metric_names)), ref=zeros(), out_of_range=zeros())

    def _add_micro_step(self, window: _Window, loss, weight, metrics) -> torch.Tensor | None:
        """Adds this micro-step to the window; returns its weight, or None if its input is bad."""
        w, kind, problem = _as_weight(weight, self.device)
        if kind is None and not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            kind, problem = BadInput.BAD_LOSS, f"loss must be a scalar floating-point tensor, got {_describe(loss)}"
        elif kind is None and not loss.requires_grad and not (isinstance(weight, numbers.Real) and weight == 0):
            # Only a rank with nothing to contribute may pass a constant loss.
            kind, problem = BadInput.BAD_LOSS, "loss does not require a gradient (computed under no_grad, or detached?)"
        values, metric_problem = self._metric_values(metrics)
        if kind is None and metric_problem:
            kind, problem = BadInput.BAD_METRIC, metric_problem
        if kind is not None:
            if window.problem is None:
                window.problem, window.problem_kind = problem, kind
            return None

        # A tensor weight is checked on its device: no synchronisation with the host.
        out_of_range = ~torch.isfinite(w) | (w < 0)
        w = torch.where(out_of_range, 0.0, w)
        window.out_of_range += out_of_range
        window.ref = torch.where(window.ref > 0, window.ref, w)
        lossd = loss.detach().reshape(()).to(torch.float64)
        local = window.local
        local[WEIGHT] += w
        # A rank without data adds nothing to the loss, but its non-finite values still count.
        local[LOSS_SUM] += torch.where(w > 0, w * lossd, 0.0)
        local[LOSS_NONFINITE] += (~torch.isfinite(lossd)).to(torch.float64)
        if values is not None:
            local[NUM_SLOTS:] += values
        return w

    def _metric_values(self, metrics: Mapping) -> tuple[torch.Tensor | None, str | None]:
        """The declared metrics as one float64 vector, or why they cannot be."""
        unknown = sorted(set(metrics) - set(self.metric_names))
        if unknown:
            return None, f"metrics {unknown} were not declared in WeightedDDP(metric_names={self.metric_names})"
        if not metrics:
            return None, None
        values: list[torch.Tensor | float] = []
        for name in self.metric_names:
            value = metrics.get(name, 0.0)
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
                values.append(value.detach().reshape(()).to(device=self.device, dtype=torch.float64))
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                values.append(float(value))
            else:
                return None, f"metric '{name}' must be a real number, got {_describe(value)}"
        if all(isinstance(v, float) for v in values):
            return _to_device(values, self.device), None
        as_tensors = [v if isinstance(v, torch.Tensor) else _to_device([v], self.device)[0] for v in values]
        return torch.stack(as_tensors), None

    @staticmethod
    def _backprop(loss: torch.Tensor, weight: torch.Tensor, ref: torch.Tensor) -> None:
        # Gradients are accumulated in units of `ref` (Note [Weighted reduction] in csrc/engine.h):
        # the first micro-step backpropagates the loss unscaled, later ones by weight / ref.
        scale = torch.where(ref > 0, weight / ref.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
        (loss * scale.to(loss.dtype)).backward()

    @property
    def bucket_params(self) -> list[list[int]]:
        """Each bucket's parameters (indices into the parameters that require grad), in launch order."""
        return self._engine.bucket_params()


def _to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers as a float64 tensor on `device`, without waiting for the device's queue."""
    host = torch.tensor(values, dtype=torch.float64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _as_weight(weight, device: torch.device) -> tuple[torch.Tensor, BadInput | None, str | None]:
    """The weight as a float64 scalar on `device`; host-side numbers are checked here, tensors on device."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
            return zero, BadInput.WEIGHT_NOT_A_NUMBER, f"weight must be a real scalar, got {_describe(weight)}"
        return weight.detach().reshape(()).to(device=device, dtype=torch.float64), None, None
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        return zero, BadInput.WEIGHT_NOT_A_NUMBER, f"weight must be a real number, got {_describe(weight)}"
    value = float(weight)
    if not math.isfinite(value) or value < 0:
        return zero, BadInput.WEIGHT_OUT_OF_RANGE, f"weight must be finite and non-negative, got {value}"
    return torch.full((), value, dtype=torch.float64, device=device), None, None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _bad_input_message(host: torch.Tensor, own_problem: str | None, rank: int) -> str:
    count = int(host[BAD_RANKS])
    if count == 1:
        kind = BadInput(round(float(host[BAD_KIND_SUM])))
        who = f"rank {int(host[BAD_RANK_SUM]) - 1} passed {kind.describe()}"
    else:
        who = f"{count} ranks passed bad input (a negative, NaN, infinite or non-numeric weight, or a bad loss)"
    mine = f"; on this rank ({rank}): {own_problem}" if own_problem else ""
    return f"hsync: WeightedDDP.backward: {who}{mine}. The step was not applied; no rank took it."


def _resolve_timeout(timeout: datetime.timedelta | None) -> float:
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
        raise TypeError(f"timeout must be a datetime.timedelta, got {_describe(timeout)}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"the collective timeout must be positive and finite, got {seconds} s")
    if seconds > _MAX_TIMEOUT.total_seconds():
        raise ValueError(f"the collective timeout must be at most {_MAX_TIMEOUT.days} days, got {seconds} s")
    return seconds


def _make_comm(group: dist.ProcessGroup, device: torch.device, timeout_s: float):
    """The engine's communicator: NCCL of our own on GPU (Note [NCCL bootstrap]), the process group on CPU."""
    # Keys unique to this wrapper and this attempt: torchrun may restart workers on the same store.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hsync/{attempt}/{dist.distributed_c10d._get_process_group_name(group)}/{next(_instances)}"
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
    signature = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
                 for name, p in module.named_parameters()]
    signature += [("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in module.named_buffers()]
    problems = []
    devices = sorted({str(p.device) for p in module.parameters()})
    if len(devices) > 1:
        problems.append(f"parameters on several devices ({', '.join(devices)}); wrap a single-device module")
    if not any(p.requires_grad for p in module.parameters()):
        problems.append("the module has no parameter that requires a gradient")
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.sparse:
            problems.append(f"'{name}' produces sparse gradients (sparse=True); hsync reduces dense gradients only")
    return signature, problems


def _verify_same_model(group: dist.ProcessGroup, module: nn.Module) -> None:
    """Raises the same ValueError on every rank if the ranks' models differ or one cannot be wrapped."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, _model_signature(module), group=group)
    for rank, (_, problems) in enumerate(gathered):
        if problems:
            raise ValueError(f"hsync: cannot wrap the model: on rank {rank}, {problems[0]}")
    reference = gathered[0][0]
    for rank, (signature, _) in enumerate(gathered[1:], start=1):
        difference = _first_difference(reference, signature, rank)
        if difference:
            raise ValueError(f"hsync: the model differs across ranks: {difference}")


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
