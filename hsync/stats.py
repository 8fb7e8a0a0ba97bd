"""The per-step scalars: one fused all-reduce carries weight, loss, flags and user metrics. Their layout,
how the micro-steps of a window fill them (Window), and how the reduced ones read (StepStats).

Slot 0 must hold the weight: the engine derives its pack scale from it (Note [Weighted reduction]
in csrc/engine.h). The other slots are ours alone.
"""

from __future__ import annotations

import enum
import math
import numbers
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hsync.errors import describe

WEIGHT, LOSS_SUM, LOSS_NONFINITE, BAD_RANKS, BAD_RANK_SUM, BAD_KIND_SUM = range(6)
NUM_SLOTS = 6

MAX_WEIGHT = 2.0**53
"""The largest weight: float64 counts examples or tokens exactly up to it, and a weight far beyond it overflowed
float32 gradients scaled by it (on the CPU a rank packs w_r g_r) while the step read as finite."""


class BadInput(enum.IntEnum):
    """Why a rank's input to backward() was refused; summed over ranks in slot BAD_KIND_SUM."""

    WEIGHT_OUT_OF_RANGE = 1
    WEIGHT_NOT_A_NUMBER = 2
    BAD_LOSS = 3
    BAD_METRIC = 4

    def describe(self) -> str:
        return {
            BadInput.WEIGHT_OUT_OF_RANGE: "a weight that is negative, NaN, infinite or above 2**53",
            BadInput.WEIGHT_NOT_A_NUMBER: "a weight that is not a real number",
            BadInput.BAD_LOSS: "a loss that is not a scalar floating-point tensor with a gradient",
            BadInput.BAD_METRIC: "a metric that is not a number or not declared in WeightedDDP(metric_names=...)",
        }[self]


def step_is_finite(reduced: list[float] | torch.Tensor, grad_nonfinite: float) -> bool:
    """Whether a synchronised step is one to take, from its reduced scalars and its gradients' flag: every
    rank's loss and gradients finite, and a total weight above 0 (a plain step under Join counts 1 a rank)."""
    return float(reduced[WEIGHT]) > 0 and float(reduced[LOSS_NONFINITE]) == 0 and grad_nonfinite == 0


class StepStats:
    """Global statistics of one synchronised step.

    The scalars were reduced at the start of the step; the gradient flag comes from the buckets'
    own all-reduce. Reading `finite` waits for the step's reduction on GPU; nothing else does.
    """

    def __init__(self, reduced: torch.Tensor, grad_nonfinite: torch.Tensor, metric_names: tuple[str, ...],
                 check_comm: Callable[[], None] = lambda: None, busy: Callable[[], float] | None = None):
        self._reduced = reduced.tolist()  # already on the host, see WeightedDDP.backward
        self._grad_nonfinite = grad_nonfinite
        self._metric_names = metric_names
        self._check_comm = check_comm
        self._busy = busy

    @property
    def busy_seconds(self) -> float | None:
        """This rank's own time for the step: from the end of its previous weighted step to the end of
        its backward in this one, less the time it waited for its peers meanwhile (for rank 0's
        buffers in a forward, for the step's total weight). It counts the data, forward, backward and
        optimizer work between the two, on the timeline where that work runs: the host's clock on the
        CPU, CUDA events on a GPU, where waits for peers are the stream's and are bracketed by events
        too (Note [Busy time] in csrc/busy_clock.h); reading it there waits for this rank's backward.
        None for a rank's first weighted step, and after a step whose backward raised."""
        return None if self._busy is None else self._busy()

    @property
    def weight(self) -> float:
        """The sum of the weights of every rank and micro-step."""
        return self._reduced[WEIGHT]

    @property
    def loss(self) -> float:
        """The global weighted-mean loss: sum of n * loss over ranks and micro-steps, divided by weight. Of
        the loss given to backward: with a GradScaler's scaler.scale(loss), divide by the scale it used
        (scaler.get_scale() before scaler.update())."""
        return self._reduced[LOSS_SUM] / self.weight if self.weight > 0 else float("nan")

    @property
    def finite(self) -> bool:
        """False when any rank's loss or unscaled gradient held an inf or NaN, or its backward raised
        midway (its gradient is partial), or no rank had an example (a total weight of 0: the mean, as
        the loss, is undefined, and an optimizer stepping on zeros would still decay and move): skip
        this step everywhere."""
        grad_nonfinite = float(self._grad_nonfinite)
        # On GPU, waiting for the flag is waiting for the buckets: a collective that failed meanwhile
        # (its values are garbage) raises here, before anyone steps on them.
        self._check_comm()
        return step_is_finite(self._reduced, grad_nonfinite)

    @property
    def metrics(self) -> dict[str, float]:
        """Each declared metric, summed over ranks and micro-steps."""
        return {name: self._reduced[NUM_SLOTS + i] for i, name in enumerate(self._metric_names)}

    def __repr__(self) -> str:
        return f"StepStats(loss={self.loss:.6g}, weight={self.weight:.6g}, finite={self.finite})"


@dataclass
class Window:
    """What the micro-steps of one accumulation window (no_sync ... synced step) add up to."""

    local: torch.Tensor
    """This rank's step scalars in the slot layout above (float64 on the model's device)."""
    ref: torch.Tensor
    """The weight local gradients are expressed in: the window's first non-zero weight, or 1 on every
    rank with a common unit (cross_rank_backward)."""
    out_of_range: torch.Tensor
    """How many weights of the window were negative, NaN, infinite or above MAX_WEIGHT (checked on the device)."""
    problem: str | None = None
    """This rank's first bad input found on the host, raised on every rank at the synced step."""
    problem_kind: BadInput | None = None
    witness: tuple[weakref.ref, weakref.ref, int] | None = None
    """A parameter its micro-steps left a gradient on, that gradient and its version then (weakly): a zero_grad()
    between micro-steps (set to None, or zeroed in place) abandons the window with the gradients."""

    @classmethod
    def open(cls, device: torch.device, metrics: int, common_unit: bool) -> Window:
        """An empty window with room for `metrics` user sums; `common_unit`: ref is 1 on every rank, for
        backward passes that mix the ranks' gradients, else the window's first non-zero weight."""
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=device)

        return cls(local=zeros(NUM_SLOTS + metrics), ref=zeros().fill_(1.0) if common_unit else zeros(),
                   out_of_range=zeros())

    def add(self, loss, weight, metrics: Mapping, metric_names: tuple[str, ...]) -> torch.Tensor | None:
        """Adds a micro-step; returns its weight on the device, or None if its input is bad."""
        device = self.local.device
        w, kind, problem = as_weight(weight, device)
        if kind is None and not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            kind, problem = BadInput.BAD_LOSS, f"loss must be a scalar floating-point tensor, got {describe(loss)}"
        elif kind is None and not loss.requires_grad and not (isinstance(weight, numbers.Real) and weight == 0):
            # Only a rank with nothing to contribute may pass a constant loss.
            kind, problem = BadInput.BAD_LOSS, "loss does not require a gradient (computed under no_grad, or detached?)"
        values, metric_problem = metric_values(metrics, metric_names, device)
        if kind is None and metric_problem:
            kind, problem = BadInput.BAD_METRIC, metric_problem
        if kind is not None:
            if self.problem is None:
                self.problem, self.problem_kind = problem, kind
            return None

        # A tensor weight is checked on its device: no synchronisation with the host.
        out_of_range = ~torch.isfinite(w) | (w < 0) | (w > MAX_WEIGHT)
        w = torch.where(out_of_range, 0.0, w)
        self.out_of_range += out_of_range
        self.ref = torch.where(self.ref > 0, self.ref, w)
        lossd = loss.detach().reshape(()).to(torch.float64)
        self.local[WEIGHT] += w
        # A rank without data adds nothing to the loss, but its non-finite values still count.
        self.local[LOSS_SUM] += torch.where(w > 0, w * lossd, 0.0)
        self.local[LOSS_NONFINITE] += (~torch.isfinite(lossd)).to(torch.float64)
        if values is not None:
            self.local[NUM_SLOTS:] += values
        return w

    def scalars(self, rank: int) -> torch.Tensor:
        """The window's scalars as the step sends them: with the bad-input slots filled for `rank`."""
        scalars = self.local
        if self.problem is not None:
            scalars[BAD_RANKS] = 1
            scalars[BAD_KIND_SUM] = int(self.problem_kind)
        else:
            scalars[BAD_RANKS] = (self.out_of_range > 0).to(torch.float64)
            scalars[BAD_KIND_SUM] = scalars[BAD_RANKS] * int(BadInput.WEIGHT_OUT_OF_RANGE)
        scalars[BAD_RANK_SUM] = scalars[BAD_RANKS] * (rank + 1)
        return scalars


def metric_values(metrics: Mapping, names: tuple[str, ...],
                  device: torch.device) -> tuple[torch.Tensor | None, str | None]:
    """The declared metrics as one float64 vector on `device`, or why they cannot be."""
    unknown = sorted(set(metrics) - set(names))
    if unknown:
        return None, f"metrics {unknown} were not declared in WeightedDDP(metric_names={names})"
    if not metrics:
        return None, None
    values: list[torch.Tensor | float] = []
    for name in names:
        value = metrics.get(name, 0.0)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            values.append(scalar_on(value, device))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            values.append(float(value))
        else:
            return None, f"metric '{name}' must be a real number, got {describe(value)}"
    if all(isinstance(v, float) for v in values):
        return to_device(values, device), None
    as_tensors = [v if isinstance(v, torch.Tensor) else to_device([v], device)[0] for v in values]
    return torch.stack(as_tensors), None


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers as a float64 tensor on `device`, without waiting for the device's queue."""
    return moved_to(torch.tensor(values, dtype=torch.float64), device)


def scalar_on(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A one-element tensor as a float64 scalar on `device`, without waiting for the device's queue."""
    return moved_to(value.detach().reshape(()).to(torch.float64), device)


def moved_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. From the host to a GPU through pinned memory, not blocking: a copy from pageable
    memory, or a blocking one, would first wait for everything queued on the device."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def as_weight(weight, device: torch.device) -> tuple[torch.Tensor, BadInput | None, str | None]:
    """The weight as a float64 scalar on `device`; host-side numbers are checked here, tensors on device."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
            return zero, BadInput.WEIGHT_NOT_A_NUMBER, f"weight must be a real scalar, got {describe(weight)}"
        return scalar_on(weight, device), None, None
    if getattr(weight, "size", None) == 1 and hasattr(weight, "item") and not isinstance(weight, numbers.Number):
        weight = weight.item()  # an array of one number (numpy's), taken as a tensor of one element is
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        return zero, BadInput.WEIGHT_NOT_A_NUMBER, f"weight must be a real number, got {describe(weight)}"
    value = float(weight)
    if not math.isfinite(value) or value < 0 or value > MAX_WEIGHT:
        return zero, BadInput.WEIGHT_OUT_OF_RANGE, f"weight must be finite, non-negative and at most 2**53, got {value}"
    return torch.full((), value, dtype=torch.float64, device=device), None, None


def bad_input_message(host: torch.Tensor, own_problem: str | None, rank: int) -> str:
    count = int(host[BAD_RANKS])
    if count == 1:
        kind = BadInput(round(float(host[BAD_KIND_SUM])))
        who = f"rank {int(host[BAD_RANK_SUM]) - 1} passed {kind.describe()}"
    else:
        who = f"{count} ranks passed bad input (a weight out of range or not a number, or a bad loss or metric)"
    mine = f"; on this rank ({rank}): {own_problem}" if own_problem else ""
    return (f"hsync: WeightedDDP.backward: {who}{mine}. The step was not applied; no rank took it, and its gradients "
            "are dropped (set to None), with those of its no_sync micro-batches")
