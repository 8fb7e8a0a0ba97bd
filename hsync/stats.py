"""The per-step scalars: one fused all-reduce carries weight, loss, flags and user metrics.

Slot 0 must hold the weight: the engine derives its pack scale from it (Note [Weighted reduction]
in csrc/engine.h). The other slots are ours alone.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

WEIGHT, LOSS_SUM, LOSS_NONFINITE, BAD_RANKS, BAD_RANK_SUM, BAD_KIND_SUM = range(6)
NUM_SLOTS = 6


class BadInput(enum.IntEnum):
    """Why a rank's input to backward() was refused; summed over ranks in slot BAD_KIND_SUM."""

    WEIGHT_OUT_OF_RANGE = 1
    WEIGHT_NOT_A_NUMBER = 2
    BAD_LOSS = 3
    BAD_METRIC = 4

    def describe(self) -> str:
        return {
            BadInput.WEIGHT_OUT_OF_RANGE: "a weight that is negative, NaN or infinite",
            BadInput.WEIGHT_NOT_A_NUMBER: "a weight that is not a real number",
            BadInput.BAD_LOSS: "a loss that is not a scalar floating-point tensor with a gradient",
            BadInput.BAD_METRIC: "a metric that is not a number or not declared in WeightedDDP(metric_names=...)",
        }[self]


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
        midway (its gradient is partial): skip this step everywhere."""
        grad_nonfinite = float(self._grad_nonfinite)
        # On GPU, waiting for the flag is waiting for the buckets: a collective that failed meanwhile
        # (its values are garbage) raises here, before anyone steps on them.
        self._check_comm()
        return self._reduced[LOSS_NONFINITE] == 0 and grad_nonfinite == 0

    @property
    def metrics(self) -> dict[str, float]:
        """Each declared metric, summed over ranks and micro-steps."""
        return {name: self._reduced[NUM_SLOTS + i] for i, name in enumerate(self._metric_names)}

    def __repr__(self) -> str:
        return f"StepStats(loss={self.loss:.6g}, weight={self.weight:.6g}, finite={self.finite})"
