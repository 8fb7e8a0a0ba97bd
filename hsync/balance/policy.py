"""When the split changes, and to what: the balancer's decisions as arithmetic on measurements.

No torch, no clock, no collective: a Policy is driven by each step's measurements and the step's
number, so every rank, fed the same numbers, takes the same decisions, and tests drive it with a
simulated cluster in milliseconds.

Note [Balancing policy]
Plans start from an equal split. After warm-up, probe steps run three splits that give every rank at
least two sizes (shares 1 + delta * cos(2 pi r / world + phase), for three phases), so that each
rank's fixed cost can be told from its throughput. The first decision puts the equal split in force,
which measures it; every replan_every steps after that, and at once when a rank's recent steps all
stray from its model (a rank slowed down or sped up: a change), the models are fitted again and a new
plan is adopted if it predicts a step at least a required gain shorter than the plan in force.

Like is compared with like. Both plans are judged by the same fitted models, of the same recent
window: a plan measured before a rank slowed down is never weighed against one measured after. The
models (Note [Robust fit]) pass through each rank's recent operating point, so that a plan is only as
wrong as the local slope, and plans converge on the split whose steps measure equal. The required
gain is min_gain or, if larger, the noise of the median step time measured under the plan in force
(over a window of ten steps or more, so that a change does not pass for noise), or twice the error of
the ranks' median times per unit, each weighed by the rank's share of the step time (a fast rank's tiny
work is noisy relative to itself but moves the step little): ranks whose fitted rates differ by no more
than the noise of their measurement are equal ranks, and keep an equal split. So do ranks whose best split
the fitted models predict no faster than the equal one by more than the noise: a plan away from equal
goes back to it then (after a rank's transient slowdown, say, when the models, fitted around the uneven
split, still lean a little its way), if the equal split is predicted no slower than the plan in force,
and unless such a move back measured worse since the last change (below). A single slow step (a
straggler, a garbage collection, a checkpoint written) moves nothing, as medians ignore it; a change
needs five steps in a row that stray from the model, the same way, by more than the spread of a rank's
single steps (with less, noise alone made one every few hundred steps of equal simulated ranks).

Predictions can still be wrong where ranks share a machine: moving work from one rank to another then
slows both. A plan whose first steps measure slower than predicted (by more than twice the required gain, and
at least 10%) is therefore re-measured against the plan it replaced, back to back: the predecessor runs again for
as many steps, the faster of the two stays, and if that was the predecessor, the next move must
promise twice the gain.

Note [Robust fit]
A rank's model is fixed + units * per_unit. Its per_unit comes from its recent steps alone: the median
of (busy - fixed) / units over the window (the steps since the plan in force or a change took
effect), so it follows a rank that slows down within a few steps and is not moved by a straggler. Its
fixed cost needs sizes that differ, which only probes and plan changes give: it is the intercept of a
least-squares line through the rank's history since the last change (recent steps weigh more,
halving every replan_every steps; steps of another speed would tilt it), kept from the last time
that history spread its sizes by at least 10%, and never more than
half the rank's recent step time (an intercept beyond that, from noise, would make its throughput
implausible).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hsync.balance.planner import RankCost, proportional_costs, split_time

_PROBE_DELTA = 0.5
_QUORUM = 5  # steps whose median is a measurement: two stragglers among them move nothing
_FIXED_SHARE = 0.5  # the most of a rank's recent step time its fixed cost may be
_SIZE_SPREAD = 0.1  # sizes spread less than this (relative) cannot place an intercept
_SURPRISE = 0.1  # a step this much slower or faster than its model says: not the model's own error
_MOST_GAIN = 0.5  # the required gain doubles after each plan that measured worse, up to this
# How far a median of n steps may lie from the one more steps would give: this many spreads (the interquartile
# range over the median, which a straggler moves little) over root n, about two standard errors for normal noise.
_MEDIAN_ERROR = 1.9
_MODEL_ERRORS = 2.0  # a new plan must promise this many times the error of the ranks' measured rates
_CHANGE_SPREADS = 1.5  # a change: _QUORUM steps in a row this many step spreads from the model, one way


@dataclass(frozen=True)
class PolicyConfig:
    """When a Policy measures, probes and decides (BalanceConfig's fields of the same names)."""

    world_size: int
    """Ranks the steps are split among."""
    warmup_steps: int = 2
    """Steps not measured after the start: they carry one-off costs."""
    probe_steps: int = 3
    """Steps per probe split (three splits) before the equal split is measured."""
    replan_every: int = 25
    """Steps between two fits of the cost models."""
    min_gain: float = 0.04
    """A new plan is taken only if it predicts steps at least this much shorter (a fraction)."""


@dataclass
class _Plan:
    first_step: int
    models: list[RankCost]
    predicted: float | None = None  # its step time, as predicted when it was adopted
    times: list[float] = field(default_factory=list)  # its full steps' measured times (the slowest rank's)
    checked: bool = False  # whether its first steps were compared with the prediction
    trial_of: _Plan | None = None  # the plan it re-measures against, while it is a trial


class Policy:
    """The plan in force for each step, from the measurements of the steps before (Note [Balancing policy])."""

    def __init__(self, config: PolicyConfig, first_step: int = 0) -> None:
        self.config = config
        self.first_step = first_step  # this process's first step: warm-up and probes count from it
        self.decisions = 0
        self._plans: list[_Plan] = []
        self._decided_at = -1
        self._required_gain = config.min_gain
        self._equal_refuted = False  # whether the equal split, gone back to, measured worse (until a change)
        world = config.world_size
        history = max(64, 2 * config.replan_every)
        self._units = np.zeros((history, world))
        self._busy = np.zeros((history, world))
        self._steps = np.full(history, -1, dtype=np.int64)
        self._rows = 0  # measurements recorded; the newest is at (rows - 1) % history
        self._fixed = np.zeros(world)  # each rank's fixed cost, as last determined (Note [Robust fit])
        self._reference: tuple[np.ndarray, np.ndarray] | None = None  # the models of the last decision
        self._window_from = 0  # the first step of the window the models are fitted on
        self._regime_from = 0  # the first step since the last change: older steps place no intercept
        self._noise = 0.0  # the noise of a window's median step time, as last measured (_measure_noise)
        self._rate_error = 0.0  # the error of a rank's median time per unit over a window, the largest (ditto)
        self._step_spread = 0.0  # the relative spread of one rank's steps, the largest (ditto)

    # -- what runs ---------------------------------------------------------------------------------

    def models_for(self, step: int, caps: Sequence[float]) -> list[RankCost]:
        """The cost models that split `step`: the plan adopted for it, or before any the warm-up's equal split
        and the probe splits, with each rank's micro-batch cap."""
        index = self._plan_index(step)
        if index >= 0:
            return self._plans[index].models
        probing = step - self.first_step - self.config.warmup_steps
        world = self.config.world_size
        if probing < 0:
            weights = [1.0] * world
        else:
            phase = 2 * math.pi * ((probing // self.config.probe_steps) % 3) / 3
            weights = [1 + _PROBE_DELTA * math.cos(2 * math.pi * r / world + phase) for r in range(world)]
        models = proportional_costs(weights)
        return [RankCost(c.fixed_s, c.per_unit_s, cap) for c, cap in zip(models, caps, strict=True)]

    def plan_for(self, step: int) -> list[RankCost] | None:
        """The cost models of the plan adopted for `step`; None before the first decision."""
        index = self._plan_index(step)
        return self._plans[index].models if index >= 0 else None

    def _plan_index(self, step: int) -> int:
        for i in range(len(self._plans) - 1, -1, -1):
            if self._plans[i].first_step <= step:
                return i
        return -1

    # -- measurements ------------------------------------------------------------------------------

    def observe(self, step: int, busy: Sequence[float], units: Sequence[float], full: bool) -> None:
        """Each rank's busy seconds and units of work in `step`. `full`: the step held a whole global batch
        (an epoch's short last step fits the models, but does not judge plans)."""
        if step < self.first_step + self.config.warmup_steps:
            return
        busy_now, units_now = np.asarray(busy, dtype=np.float64), np.asarray(units, dtype=np.float64)
        row = self._rows % len(self._steps)
        self._busy[row], self._units[row], self._steps[row] = busy_now, units_now, step
        self._rows += 1
        index = self._plan_index(step)
        if index >= 0 and full and bool(np.all(busy_now > 0)):
            times = self._plans[index].times
            times.append(float(busy_now.max()))  # the step took as long as its slowest rank
            del times[:-self.config.replan_every]  # a plan is judged on its recent steps

    def _history(self, since: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(units, busy, steps) of the recorded measurements, oldest first; from step `since` on, or the last
        _QUORUM if fewer are that recent. Rows where a rank measured nothing hold 0 for it."""
        count = min(self._rows, len(self._steps))
        rows = np.arange(self._rows - count, self._rows) % len(self._steps)
        if since is not None:
            recent = rows[self._steps[rows] >= since]
            rows = recent if len(recent) >= _QUORUM else rows[-_QUORUM:]
        return self._units[rows], self._busy[rows], self._steps[rows]

    # -- decisions ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether `step`'s measurements call for a decision: the first after warm-up and probes, then every
        replan_every steps, a trial that has run its steps, or a change (Note [Balancing policy])."""
        if not self._plans:
            return step >= self.first_step + self.config.warmup_steps + 3 * self.config.probe_steps
        if step - self._decided_at >= self.config.replan_every:
            return True
        current = self._plans[-1]
        if current.trial_of is not None and len(current.times) >= _QUORUM:
            return True
        return step - self._decided_at >= _QUORUM and self._changed(step)

    def _changed(self, step: int) -> bool:
        """Whether some rank's last _QUORUM steps all stray from its model, the same way, by more than the
        surprise threshold: it slowed down or sped up. The window of the next fit starts with them."""
        if self._reference is None or self._rows < _QUORUM:
            return False
        units, busy, steps = self._history()
        units, busy, steps = units[-_QUORUM:], busy[-_QUORUM:], steps[-_QUORUM:]
        fixed, per_unit = self._reference
        valid = (units > 0) & (busy > 0)
        stray = np.where(valid, busy / (fixed + units * per_unit) - 1, 0.0)
        if not np.any(np.abs(stray) > _SURPRISE):
            return False  # within the least threshold: no need to measure the noise
        if not self._step_spread:
            self._measure_noise()  # the first plan's steps: measured at no decision yet
        limit = max(self._surprise(), _CHANGE_SPREADS * self._step_spread)
        changed = bool(np.any(np.all(valid & (stray > limit), axis=0) | np.all(valid & (stray < -limit), axis=0)))
        if changed:
            self._window_from = self._regime_from = int(steps[0])
            self._equal_refuted = False
        return changed

    def decide(self, step: int, costs: Sequence[float], first_free_step: int, caps: Sequence[float]) -> None:
        """Weighs the measurements after `step` and adopts a plan for the steps from `first_free_step` on (the
        first one no rank has split yet), with these per-rank micro-batch caps; `costs` are a full step's."""
        fitted = self._fit()
        if fitted is None or not costs:
            return  # a rank has no measurement yet: decide at a later step
        self._decided_at = step
        self.decisions += 1
        # Every step split or measured from now on is `step` or later: plans in force only before it go.
        while len(self._plans) > 2 and self._plans[1].first_step <= step:
            del self._plans[0]
        self._fixed, fixed, per_unit = fitted
        self._reference = (fixed, per_unit)
        self._measure_noise()
        effective = max(step + 1, first_free_step)
        candidate = [RankCost(float(f), float(p), float(c)) for f, p, c in zip(fixed, per_unit, caps, strict=True)]
        equal = [RankCost(0.0, 1.0, float(c)) for c in caps]
        if not self._plans:
            self._adopt(effective, equal, checked=True)
            return
        current = self._plans[-1]
        if current.trial_of is not None:
            self._end_trial(effective)
            return
        if (not current.checked and current.predicted is not None and len(current.times) >= _QUORUM
                and len(self._plans) >= 2):
            current.checked = True
            if _median(current.times) > (1 + self._surprise()) * current.predicted:
                # Slower than predicted: re-measure the plan it replaced, back to back with it.
                self._adopt(effective, self._plans[-2].models, checked=True, trial_of=current)
                return
        new_time = split_time(costs, candidate, candidate)
        old_time = split_time(costs, current.models, candidate)
        equal_time = split_time(costs, equal, candidate)
        if equal_time <= (1 + self._noise_gain()) * new_time and not self._equal_refuted:
            # The best split beats the equal one by no more than the noise: equal ranks, as far as can be told,
            # and they keep (or go back to) the equal split, where noise can move nothing.
            if not _is_equal(current.models) and equal_time <= old_time:
                self._adopt(effective, equal, predicted=equal_time * self._measured_over(old_time))
        elif new_time <= (1 - self._gain()) * old_time:
            self._adopt(effective, candidate, predicted=new_time * self._measured_over(old_time))

    def _measured_over(self, predicted: float) -> float:
        """How the plan in force measured against `predicted`, its step time by the new models: what the models
        leave out (the slowest of noisy ranks sets the step), which a new plan is expected to measure alike."""
        measured = self._window_times()
        return _median(measured) / predicted if len(measured) >= _QUORUM else 1.0

    def _end_trial(self, effective: int) -> None:
        """The faster of a trial and the plan it re-measured against stays (Note [Balancing policy])."""
        trial = self._plans[-1]
        challenged, trial.trial_of = trial.trial_of, None
        if len(trial.times) >= _QUORUM and len(challenged.times) >= _QUORUM and (
                (1 + self._gain()) * _median(trial.times[-_QUORUM:]) < _median(challenged.times[-_QUORUM:])):
            self._required_gain = min(_MOST_GAIN, 2 * self._required_gain)  # the move was wrong: be warier
            self._equal_refuted |= _is_equal(challenged.models)
        else:
            self._adopt(effective, challenged.models, checked=True)

    def _adopt(self, first_step: int, models: list[RankCost], predicted: float | None = None, checked: bool = False,
               trial_of: _Plan | None = None) -> None:
        self._plans.append(_Plan(first_step, models, predicted, checked=checked, trial_of=trial_of))
        self._window_from = first_step

    def _gain(self) -> float:
        """The gain a new plan must promise: min_gain (more after a wrong move), or what the noise of the step
        times or of the ranks' fitted rates could promise alone, if larger (Note [Balancing policy])."""
        return max(self._required_gain, self._noise_gain())

    def _noise_gain(self) -> float:
        """What the noise of the step times or of the ranks' fitted rates could promise alone, or min_gain: the
        gain within which two plans are alike (without the wariness that wrong moves add)."""
        return max(self.config.min_gain, self._noise, _MODEL_ERRORS * self._rate_error)

    def _measure_noise(self) -> None:
        """The noise of the median step time over the window (twice its standard error, from the spread between
        its steps), the same for each rank's median time per unit, and the spread of a rank's single steps, when
        the window is long enough to tell: a window just after a change keeps the noise measured before it,
        which the change itself would inflate (the first is taken from five steps)."""
        needed = 2 * _QUORUM if self._step_spread else _QUORUM  # the first measurement takes fewer
        times = self._window_times()
        if len(times) < needed:
            return
        low, middle, high = np.percentile(times, [25, 50, 75])
        self._noise = _MEDIAN_ERROR * float((high - low) / middle) / math.sqrt(len(times))
        units, busy, _ = self._history(self._window_from)
        valid = (units > 0) & (busy > 0)
        counts = valid.sum(axis=0)
        measured = counts >= needed  # a filler measures nothing
        if measured.any():
            rates = _ratio(busy, units, valid)[:, measured]
            low, middle, high = np.nanpercentile(rates, [25, 50, 75], axis=0)
            spreads = (high - low) / middle
            # A rank's error in the step's terms: a rank whose own work is a small part of the step (a fast rank
            # beside a slow one) is noisy relative to itself, and moves the step's prediction little.
            share = _column_medians(busy, valid, np.zeros(busy.shape[1]))[measured]
            share = share / max(float(share.max()), 1e-12)
            self._rate_error = float((_MEDIAN_ERROR * spreads * share / np.sqrt(counts[measured])).max())
            self._step_spread = float(spreads.max())

    def _surprise(self) -> float:
        """How far measurements must stray from a prediction to show the models wrong: twice the required gain,
        and at least _SURPRISE, which the models' own error at a new operating point stays below."""
        return max(_SURPRISE, 2 * self._gain())

    def _window_times(self) -> np.ndarray:
        """The step times (the slowest rank's) of the window: the steps since the plan in force, or a change,
        took effect."""
        _, busy, _ = self._history(self._window_from)
        return busy[np.all(busy > 0, axis=1)].max(axis=1, initial=0.0)

    # -- models ------------------------------------------------------------------------------------

    def fit(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Each rank's (fixed, per_unit) as its measurements fit them now (Note [Robust fit]); None while a rank
        has fewer than a quorum of measurements. Changes nothing: a rank that reports it (rank 0's log) takes
        the same decisions as one that does not."""
        fitted = self._fit()
        return None if fitted is None else fitted[1:]

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """fit(), with first the fixed costs to remember (where the sizes placed an intercept, the new one)."""
        units, busy, steps = self._history()
        valid = (units > 0) & (busy > 0)
        if len(steps) == 0 or np.any(valid.sum(axis=0) < _QUORUM):
            return None
        # The intercept, from the history since the last change, recent steps weighing more.
        valid &= (steps >= self._regime_from)[:, None]
        weight = np.where(valid, 0.5 ** ((steps[-1] - steps) / self.config.replan_every)[:, None], 0.0)
        total = np.maximum(weight.sum(axis=0), 1e-300)
        mean_units = (weight * units).sum(axis=0) / total
        mean_busy = (weight * busy).sum(axis=0) / total
        sxx = (weight * (units - mean_units) ** 2).sum(axis=0)
        sxy = (weight * (units - mean_units) * (busy - mean_busy)).sum(axis=0)
        placed = valid.sum(axis=0) >= _QUORUM
        placed &= np.sqrt(sxx / total) >= _SIZE_SPREAD * mean_units
        slope = np.where(placed, sxy / np.where(placed, sxx, 1.0), 0.0)
        placed &= slope > 0
        # The operating point: the window's steps (since the plan in force, or a change, took effect); a rank
        # that measured nothing there (a filler) keeps its medians over the whole history.
        all_valid = (units > 0) & (busy > 0)
        everywhere_busy = _column_medians(busy, all_valid, fallback=np.ones(len(self._fixed)))
        everywhere_rate = _column_medians(_ratio(busy, units, all_valid), all_valid, fallback=np.ones(len(self._fixed)))
        w_units, w_busy, _ = self._history(self._window_from)
        w_valid = (w_units > 0) & (w_busy > 0)
        recent_busy = _column_medians(w_busy, w_valid, fallback=everywhere_busy)
        ceiling = _FIXED_SHARE * recent_busy
        remembered = np.where(placed, np.clip(mean_busy - slope * mean_units, 0.0, ceiling), self._fixed)
        fixed = np.minimum(remembered, ceiling)
        per_unit = _column_medians(_ratio(w_busy - fixed, w_units, w_valid), w_valid, fallback=everywhere_rate)
        # Positive whatever the noise: at least a small share of the plain time per unit.
        plain = _column_medians(_ratio(w_busy, w_units, w_valid), w_valid, fallback=everywhere_rate)
        return remembered, fixed, np.maximum(per_unit, 1e-3 * plain)

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The plans, measurements and fits: plain values, for a checkpoint loaded with weights_only."""
        count = min(self._rows, len(self._steps))
        rows = (np.arange(self._rows - count, self._rows) % len(self._steps)).tolist()
        def index(plan: _Plan | None) -> int | None:
            return next((i for i, p in enumerate(self._plans) if p is plan), None)

        return {
            "world_size": self.config.world_size,
            "plans": [{"first_step": p.first_step, "models": [[m.fixed_s, m.per_unit_s, m.micro_cap] for m in p.models],
                       "predicted": p.predicted, "times": list(p.times), "checked": p.checked,
                       "trial_of": index(p.trial_of)} for p in self._plans],
            "decided_at": self._decided_at, "decisions": self.decisions, "required_gain": self._required_gain,
            "equal_refuted": self._equal_refuted,
            "units": self._units[rows].tolist(), "busy": self._busy[rows].tolist(), "steps": self._steps[rows].tolist(),
            "fixed": self._fixed.tolist(),
            "reference": None if self._reference is None else [a.tolist() for a in self._reference],
            "window_from": self._window_from, "regime_from": self._regime_from, "noise": self._noise,
            "rate_error": self._rate_error, "step_spread": self._step_spread,
        }

    def load_state_dict(self, state: dict, first_step: int) -> None:
        """Goes on with a checkpoint's plans and fits from `first_step` (the step the run resumes at): its
        warm-up is not measured, and no probe runs again."""
        if state["world_size"] != self.config.world_size:
            raise ValueError(f"a policy of {state['world_size']} ranks cannot go on with {self.config.world_size}")
        self.first_step = first_step
        self._plans = [_Plan(p["first_step"], [RankCost(*m) for m in p["models"]], p["predicted"], list(p["times"]),
                             p["checked"]) for p in state["plans"]]
        for plan, saved in zip(self._plans, state["plans"], strict=True):
            plan.trial_of = None if saved["trial_of"] is None else self._plans[saved["trial_of"]]
        self._decided_at, self.decisions = state["decided_at"], state["decisions"]
        self._required_gain = state["required_gain"]
        self._equal_refuted = state.get("equal_refuted", False)  # not in checkpoints of earlier releases
        count = min(len(state["steps"]), len(self._steps))  # a shorter history (replan_every changed) keeps the last
        self._rows = count
        for ours, theirs in ((self._units, state["units"]), (self._busy, state["busy"]), (self._steps, state["steps"])):
            if count:
                ours[:count] = np.asarray(theirs[len(theirs) - count:])
        self._fixed = np.asarray(state["fixed"], dtype=np.float64)
        self._reference = None if state["reference"] is None else tuple(np.asarray(a) for a in state["reference"])
        self._window_from, self._regime_from = state["window_from"], state["regime_from"]
        self._noise = state["noise"]
        # Checkpoints of earlier releases measured neither: the next window's measurement fills them in.
        self._rate_error, self._step_spread = state.get("rate_error", 0.0), state.get("step_spread", 0.0)


def _is_equal(models: Sequence[RankCost]) -> bool:
    """Whether `models` are the equal split's (whatever their micro-batch caps)."""
    return all(m.fixed_s == 0.0 and m.per_unit_s == 1.0 for m in models)


def _median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values)))


def _ratio(numerator: np.ndarray, denominator: np.ndarray, valid: np.ndarray) -> np.ndarray:
    return np.where(valid, numerator / np.where(valid, denominator, 1.0), np.nan)


def _column_medians(values: np.ndarray, valid: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Each column's median over its valid rows (the fallback where it has none). A sort puts the invalid rows
    last, and the median is read off each column's count of valid ones: at a thousand ranks, a tenth of what
    numpy's nanmedian takes, and the same result on every machine."""
    count = valid.sum(axis=0)
    if values.size == 0 or not count.any():
        return fallback.astype(np.float64)
    ordered = np.sort(np.where(valid, values, np.inf), axis=0)
    low = np.take_along_axis(ordered, np.maximum(count - 1, 0)[None, :] // 2, axis=0)[0]
    high = np.take_along_axis(ordered, count[None, :] // 2, axis=0)[0]
    high = np.where(count % 2 == 1, low, high)
    return np.where(count > 0, (low + high) / 2, fallback)
