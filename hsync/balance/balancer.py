"""Per-rank batches for any training loop, planned from each rank's measured speed and memory.

Note [Balancer]
Each optimizer step takes the next global_batch_size examples of the epoch's shuffled order, as one
GPU would, and splits them among ranks by planner.split_step under the cost model in force for that
step. Which examples form a step never depends on the plan, only who runs which, and WeightedDDP's
update is the exact weighted mean however a step is split: changing plans, a different world size
after a restart, or a rank that takes several micro-batches all leave the updates the same, up to
the order of floating-point sums. Every rank runs every step (a rank left without an example in the
last step of an epoch runs a filler micro-batch of weight 0), so all ranks end each epoch together.
A model whose forward is itself a collective (WeightedDDP.cross_rank_backward, a SyncBatchNorm)
needs more: the same number of micro-batches on every rank and no filler, checked before each step;
its batch statistics then also depend on how a rank's share is cut into micro-batches, so only one
micro-batch per rank and step keeps the updates independent of the plan.

Measurements travel in the step's fused scalars (hsync.balance.reports): every rank fits the same
cost models from the same numbers and takes the same decisions, with no collective of its own. A
rank reports its previous step (its busy time is known only once that step ends): its time by the
balancer's clock (StepStats.busy_seconds), its units of work, the micro-batch its memory allows, and
the last step its sampler has already split. The sampler runs ahead of the loop (a DataLoader with
workers prefetches), so a new cost model takes effect at the first step no rank has split yet.

The parts: StepSplitter (splitter.py) cuts steps, pure; Policy (policy.py) decides plans from the
reports; MicroBatchMemory (memory.py) bounds a GPU rank's micro-batches; the Balancer drives them
from the training loop's side, through WeightedDDP's BalancedSteps.

When and to what the split changes is decided by hsync.balance.policy (Note [Balancing policy]), from
these measurements alone.

Note [Out of memory]
On a GPU a micro-batch larger than any this rank has run (the probe splits', a new plan's) may not fit, nor
may any after parameters were unfrozen (WeightedDDP.refresh_trainable_parameters): the Balancer then forgets
the peaks it measured, and every size counts as never run until measured again.
forward_backward(batch, loss_of) runs such a micro-batch with a way back: the parameters' gradients
are copied to host memory first, and, like every micro-batch it runs, it runs under no_sync, so that
a failure leaves no collective half done. If it runs out of memory, in its forward or midway through
its backward, the gradients and the accumulation window's scalars are restored, and the batch runs
again in halves (quarters if a half does not fit, ...): every example once, and the same gradient as in
one piece. The step is then reduced without another backward (WeightedDDP.backward of a constant loss
of weight 0 reduces what the window accumulated). From then on the rank's capacity, which every rank
reads in the step's scalars and plans with, is at most half the size that failed.
"""

from __future__ import annotations

import array
import hashlib
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsync.balance.clock import StepClock
from hsync.balance.memory import DeviceMemory, MicroBatchMemory, PeakMemory
from hsync.balance.planner import RankCost
from hsync.balance.policy import Policy, PolicyConfig
from hsync.balance.reports import Report, ReportCodec
from hsync.balance.retry import GradientBackup, halves, rows_of
from hsync.balance.splitter import MicroBatch, StepSplitter
from hsync.collectives import Channels
from hsync.ddp import WeightedDDP
from hsync.errors import describe
from hsync.stats import StepStats


@dataclass(frozen=True)
class BalanceConfig:
    """How a Balancer splits each step among ranks (frozen: the Balancer's parts keep what they were given;
    dataclasses.replace makes a changed copy)."""

    global_batch_size: int
    """Examples in one optimizer step, summed over ranks (an epoch's last step takes what is left)."""
    rank_batch_sizes: Sequence[int] | None = None
    """A fixed split of every step, one size per rank, adding up to global_batch_size; nothing is
    measured. None: the split is planned from measured speeds."""
    micro_batch_limit: float | Sequence[float] | None = None
    """Most units of work (examples, or tokens when examples have costs) in one micro-batch, for every
    rank or one value per rank: a larger share runs as several micro-batches in a no_sync window.
    None: no limit on the CPU; on a GPU, found from the peak memory of the steps run so far."""
    warmup_steps: int = 2
    """Steps not measured after the start: they carry one-off costs (allocations, the first connection)."""
    probe_steps: int = 3
    """Steps per probe split (three splits) before the equal split is measured and plans begin."""
    replan_every: int = 25
    """Steps between two fits of the cost models."""
    min_gain: float = 0.04
    """A new plan is taken only if it predicts steps at least this much shorter (a fraction)."""
    memory_fraction: float = 0.9
    """Of the GPU memory this rank's allocator holds and can still take (what the CUDA context, NCCL and
    other processes left), what a micro-batch's allocations may reach at their peak."""
    seed: int = 0
    """Seeds the order of examples: epoch e is torch.randperm seeded with seed + e, as torch's DistributedSampler
    draws it (so a step takes the examples of DDP's global batch under that sampler)."""
    shuffle: bool = True
    """Whether each epoch shuffles the examples; False keeps the dataset's order."""
    drop_last: bool = False
    """Whether an epoch's last step is dropped when it holds fewer than global_batch_size examples (as a
    DataLoader's drop_last); False: it takes what is left."""

    def __post_init__(self) -> None:
        def is_whole(value) -> bool:  # numpy's integers too; kept as Python's below
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        def positive_int(name: str, value, least: int = 1) -> None:
            if not is_whole(value) or value < least:
                raise ValueError(f"BalanceConfig.{name} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))

        positive_int("global_batch_size", self.global_batch_size)
        positive_int("warmup_steps", self.warmup_steps, 0)
        positive_int("probe_steps", self.probe_steps)
        positive_int("replan_every", self.replan_every)
        for name in ("min_gain", "memory_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"BalanceConfig.{name} must be a number, got {value!r}")
        limit = self.micro_batch_limit
        per_rank = list(limit) if isinstance(limit, Sequence) and not isinstance(limit, str) else [limit]
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0)
               for v in per_rank):
            raise ValueError(f"BalanceConfig.micro_batch_limit must be None, a positive number or one per rank, "
                             f"got {limit!r}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"BalanceConfig.min_gain must be in [0, 1), got {self.min_gain!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"BalanceConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if not is_whole(self.seed):
            raise ValueError(f"BalanceConfig.seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BalanceConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.rank_batch_sizes is not None:
            sizes = list(self.rank_batch_sizes)
            if any(not is_whole(n) or n < 0 for n in sizes) or sum(sizes) != self.global_batch_size:
                raise ValueError(f"BalanceConfig.rank_batch_sizes {sizes} must be non-negative integers adding "
                                 f"up to global_batch_size {self.global_batch_size}")
            object.__setattr__(self, "rank_batch_sizes", [int(n) for n in sizes])


class Balancer:
    """A batch sampler that hands each rank its share of every global batch, planned from measurements.

        balancer = hsync.Balancer(model, len(dataset), hsync.BalanceConfig(global_batch_size=64))
        loader = DataLoader(dataset, batch_sampler=balancer, num_workers=2, pin_memory=True)
        for epoch in range(balancer.epoch, epochs):  # after load_state_dict: where it left off
            balancer.set_epoch(epoch)
            for x, y in loader:
                loss = loss_fn(model(x.to(device)), y.to(device))
                if stats := balancer.backward(loss):  # the step's StepStats on its last micro-batch, else None
                    if stats.finite:
                        optimizer.step()
                    optimizer.zero_grad()

    Iterating yields this rank's micro-batches (lists of dataset indices), step after step; call
    backward() once per micro-batch, in order, or forward_backward(batch, loss_of), which on a GPU runs
    a micro-batch that does not fit again in parts (Note [Out of memory]). `examples` is the dataset's
    size, or one cost per example (its length in tokens) to balance and weigh by tokens. See Note
    [Balancer]. For benchmarks and tests, keyword only: `clock` times this rank's steps (default:
    StepStats.busy_seconds; a simulated slow GPU, known costs), `memory` reads its device's memory (default:
    the GPU's allocator; none on the CPU; a simulated device).
    """

    def __init__(self, model: WeightedDDP, examples: int | Sequence[float], config: BalanceConfig, *,
                 clock: StepClock | None = None, memory: PeakMemory | None = None) -> None:
        model = getattr(model, "_orig_mod", model)  # torch.compile(WeightedDDP(net)): the wrapper it compiled
        if not isinstance(model, WeightedDDP):
            raise TypeError(f"hsync.Balancer needs the hsync.WeightedDDP that trains, got {type(model).__name__}")
        if not isinstance(config, BalanceConfig):
            raise TypeError(f"hsync.Balancer takes an hsync.BalanceConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self.rank, self.world_size = model.rank, model.world_size
        # What bounds micro-batches besides micro_batch_limit: a GPU's memory (on the CPU, nothing).
        if memory is None and model.device.type == "cuda":
            memory = DeviceMemory(model.device)
        self._memory = MicroBatchMemory(memory, config.memory_fraction) if memory is not None else None
        # A refusal of this rank's own arguments is raised on every rank, so no peer waits in the check.
        refusal = None
        try:
            costs = _example_costs(examples)
            self._limits = self._micro_batch_limits()
        except ValueError as error:
            costs, refusal = [1.0], str(error)
        if config.drop_last and refusal is None and len(costs) < config.global_batch_size:
            refusal = (f"hsync.Balancer: drop_last leaves no step of {config.global_batch_size} examples in an "
                       f"epoch of {len(costs)}")
        self._splitter = StepSplitter(costs, config.global_batch_size, self.world_size, seed=config.seed,
                                      shuffle=config.shuffle, drop_last=config.drop_last,
                                      rank_batch_sizes=config.rank_batch_sizes)
        self._check_same_everywhere(refusal)
        # A GPU rank's micro-batch before its memory is measured: an equal share, at the longest length.
        self._equal_share_units = -(-config.global_batch_size // self.world_size) * max(costs)
        self._codec = ReportCodec(self.world_size)
        self._clock = clock if clock is not None else StepClock()
        # Only a clock that acts there is called when a step's own work is done (a simulated slow rank's pause).
        acts = type(self._clock).own_work_done is not StepClock.own_work_done
        self._steps = model._balance(self._codec.metric_names, (
            lambda: self._clock.own_work_done(self._steps.busy_seconds_so_far, self._step_units)) if acts else None)
        if model.cross_rank_backward:  # read after _balance, which finds a SyncBatchNorm converted in after the wrap
            self._splitter.check_epoch_end_lockstep()
        self.epoch = 0
        self._step_in_epoch = 0     # steps of this epoch completed
        self.global_step = 0        # steps completed, over all epochs (and runs, once resumed)
        self._policy = Policy(self._policy_config())
        self._pending: deque[MicroBatch] = deque()
        self._backward_called = False  # balancer.backward has taken a micro-batch
        self._steps_before = self._steps.synchronised  # the model's synchronised steps before this balancer's
        self._refreshes_seen = self._steps.refreshes
        self._split_through = -1    # the last step the sampler has split
        # Per step split and not completed yet: each rank's number of examples, and the step's costs.
        self._split_steps: dict[int, tuple[list[int], list[float]]] = {}
        self._step_units = 0.0      # this rank's units of work in the current step
        self._micro_batches_in_step = 0  # of the current step, backpropagated on this rank
        self._previous: tuple[StepStats, float] | None = None  # the last step's stats and this rank's units
        self._measured_step_full = True  # whether the last step held a whole global batch
        self.last_reports: list[Report] = []
        """What each rank reported with the last completed step (Note [Balancer]: its time and units are of the
        step before)."""
        self.last_plan: list[int] = []
        """Examples of each rank in the last completed step."""

    # -- the sampler -------------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch: ceil(examples / global_batch_size) (floor with drop_last), on every rank."""
        return self._splitter.steps_per_epoch

    @property
    def epoch_progress(self) -> float:
        """The epochs completed, with the fraction of this one done (epoch 2 after a third of its steps: 2.33),
        resumed runs included: what Trainer logs as `epoch`."""
        return self.epoch + self._step_in_epoch / self.steps_per_epoch

    def __len__(self) -> int:
        """steps_per_epoch, so that len(loader) sizes a learning-rate schedule or a progress bar as with
        DistributedSampler. A rank that runs its share of a step in several micro-batches yields more
        batches than this: count steps by what backward() returns."""
        return self.steps_per_epoch

    @property
    def batch_size(self) -> int:
        """Refused: a rank's micro-batches have no one size. Its reader is a wrapper that would cut the batches
        into per-rank shards again (Accelerate's prepare() reads it first), and every rank would then train
        on part of its share, silently."""
        raise TypeError(
            "hsync.Balancer already gives each rank its own share of every step and has no one batch size: do not "
            "shard its loader again (accelerate's prepare(), a DistributedSampler); hand the DataLoader to your "
            "loop as it is (Accelerate: hsync.integrations.accelerate.Accelerator, whose prepare() keeps it whole; "
            "transformers.Trainer: hsync.integrations.transformers.Trainer)")

    def set_epoch(self, epoch: int) -> None:
        """Starts `epoch` (each has its own order), or goes on where a resumed run left it."""
        if epoch != self.epoch:
            self.epoch, self._step_in_epoch = epoch, 0

    def __iter__(self) -> Iterator[list[int]]:
        # A new iteration (a DataLoader's next epoch, or a loop that broke off) starts at the first step
        # not completed: what an earlier iterator split ahead is forgotten.
        self._pending.clear()
        self._split_steps.clear()
        self._split_through = self.global_step - 1
        first = self._step_in_epoch
        base = self.global_step - first  # the global index of this epoch's step 0
        for split in self._splitter.steps(self.epoch, first, base, self.rank, self._models_for,
                                          lockstep=self.model.cross_rank_backward):
            step = split.micro_batches[0].step
            self._split_steps[step] = (split.sizes, split.costs)
            self._split_through = step
            for micro in split.micro_batches:
                self._refuse_steps_of_the_loops_own()
                self._pending.append(micro)
                yield micro.indices

    def steps(self) -> Iterator[list[list[int]]]:
        """Iterates as iter(self) does, a step at a time: the list of this rank's micro-batches of each step, for a
        loader whose one item is a whole optimizer step (hsync.integrations._loaders.StepLoader)."""
        micro_batches: list[list[int]] = []
        for indices in self:
            micro_batches.append(indices)
            if self._pending[-1].last:
                yield micro_batches
                micro_batches = []

    # -- the training loop's side ------------------------------------------------------------------

    @property
    def filler(self) -> bool:
        """Whether the micro-batch awaiting its backward is a filler: a rank without an example in an epoch's
        last step runs another rank's with weight 0. A loop's own counts (metrics) should skip it."""
        return bool(self._pending) and self._pending[0].filler

    @property
    def step_begun(self) -> bool:
        """Whether micro-batches of the step in hand have had their backward on this rank, and the step's last has
        not: the gradients then hold this rank's partial sum, which a zero_grad() would lose and a clipping or an
        optimizer step would take for the step's."""
        return self._micro_batches_in_step > 0

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None = None,
                 metrics: Mapping[str, float | torch.Tensor] | None = None) -> StepStats | None:
        """WeightedDDP.backward for the micro-batch the sampler yielded last-but-pending: inside no_sync
        except on this rank's last micro-batch of the step, where it synchronises, feeds the
        measurements back and returns the step's StepStats (None before). `weight` defaults to the
        micro-batch's number of examples; pass tokens when the loss is a mean over tokens."""
        if self.model._join_config.enable:
            # Under Join every forward is a collective, and ranks here run different numbers of micro-batches.
            # Raised on every rank at its first micro-batch, before its backward's collectives.
            raise RuntimeError("hsync.Balancer does not run under model.join(), and needs no Join: every rank runs "
                               "every step (one without examples runs a filler of weight 0), so no rank runs out "
                               "of inputs before the others")
        self._forget_memory_after_a_refresh()
        if self._pending and self._pending[0].last and not self.model.require_backward_grad_sync:
            # Refused before this rank's collectives: its peers wait in the step's, and fail at the deadline.
            raise RuntimeError("hsync.Balancer.backward: called inside the model's no_sync() on this rank's last "
                               "micro-batch of the step, whose backward must synchronise; the Balancer runs the "
                               "others under no_sync itself: call it outside no_sync()")
        micro = self._take_micro_batch()
        weight = _weight(micro, weight, micro.examples)
        if not micro.last:
            self._accumulate(loss, weight, metrics, micro.units)
            return None
        return self._synchronise(micro, loss, weight, metrics, measured_units=micro.units)

    def forward_backward(self, batch: Any, loss_of: Callable[[Any], Any]) -> StepStats | None:
        """backward() with the micro-batch's forward: `loss_of(batch)` runs the model and returns the loss, or
        (loss, weight, metrics) as backward() takes them. On a GPU a micro-batch larger than any this rank
        has run, if it runs out of memory, is undone and runs again in halves of `batch` (cut along the
        first dimension of its tensors), every example once, with the same gradients as in one piece; this
        rank's micro-batches keep below that size from then on, in every rank's plans (Note [Out of
        memory]). Returns what backward() returns."""
        self._forget_memory_after_a_refresh()
        micro = self._peek_micro_batch()
        if not self._may_run_out(micro.units):
            return self.backward(*_loss_weight_metrics(loss_of(batch)))
        self._take_micro_batch()
        self._run_in_parts(micro, batch, loss_of)
        if not micro.last:
            return None
        # What the parts accumulated, reduced by a backward of nothing.
        nothing = torch.zeros((), dtype=torch.float64, device=self.model.device)
        return self._synchronise(micro, nothing, 0.0, None, measured_units=None)

    def _forget_memory_after_a_refresh(self) -> None:
        """Parameters unfrozen since the last micro-batch (WeightedDDP.refresh_trainable_parameters) take memory of
        their own, gradients and activations: the sizes measured so far no longer tell what fits."""
        if self._steps.refreshes != self._refreshes_seen:
            self._refreshes_seen = self._steps.refreshes
            if self._memory is not None:
                self._memory.forget()

    def _peek_micro_batch(self) -> MicroBatch:
        if not self._pending:
            raise RuntimeError("hsync.Balancer.backward: no micro-batch of this balancer is waiting for its "
                               "backward (call it once per batch its sampler yielded, in order)")
        return self._pending[0]

    def _refuse_steps_of_the_loops_own(self) -> None:
        """A loop that kept DDP's loss.backward() (or calls model.backward() itself) on the balancer's micro-batches
        weights the ranks' shares alike, though they differ in size, and the plan never measures a step: refused
        at the next micro-batch asked for, on every rank alike (each runs the same loop)."""
        if not self._backward_called and self._pending and self._steps.synchronised > self._steps_before:
            raise RuntimeError("hsync.Balancer: the model took a synchronised step of the loop's own "
                               "(loss.backward() or model.backward()) on a micro-batch of this balancer's; call "
                               "balancer.backward(loss) instead, once per micro-batch, so that each rank's share is "
                               "weighted by its examples and the plan measured")

    def _take_micro_batch(self) -> MicroBatch:
        micro = self._peek_micro_batch()
        self._backward_called = True
        self._pending.popleft()
        self._step_units += micro.units
        self._micro_batches_in_step += 1
        return micro

    def _accumulate(self, loss: torch.Tensor, weight, metrics, units: float) -> None:
        with self.model.no_sync():
            self.model.backward(loss, weight, metrics)
        if self._memory is not None:
            self._memory.measure(units)

    def _synchronise(self, micro: MicroBatch, loss: torch.Tensor, weight, metrics,
                     measured_units: float | None) -> StepStats:
        """The step's synchronised backward, with this rank's report in its scalars."""
        busy, units = 0.0, 0.0
        if self._previous is not None and (seconds := self._clock.step_seconds(*self._previous)) is not None:
            busy, units = seconds, self._previous[1]
        report = Report(busy, units, self._capacity(), self._split_through + 1, micro.step, self.epoch)
        steps_before = self._steps.completed
        try:
            stats = self.model.backward(loss, weight, {**(metrics or {}), **self._codec.encode(self.rank, report)})
        except BaseException:
            if self._steps.completed > steps_before:
                # The step ran on every rank (a backward that raised still completes it): counted here as
                # by the peers, or this rank would number, and so split, its later steps differently. A step
                # refused for a rank's bad input (on every rank alike) lacks that rank's report: not read.
                self._step_done(micro.step, self._steps.last_stats(), reports_sent=not self._steps.last_refused)
            raise
        if measured_units is not None and self._memory is not None:
            self._memory.measure(measured_units)
        self._clock.step_done()
        self._step_done(micro.step, stats)
        return stats

    def _may_run_out(self, units: float) -> bool:
        """Whether a micro-batch of `units` is run with a way back (Note [Out of memory]): on a GPU, larger
        than any this rank has run. Not with cross_rank_backward, whose ranks must run the same forwards."""
        return self._memory is not None and not self.model.cross_rank_backward and self._memory.may_run_out(units)

    def _run_in_parts(self, micro: MicroBatch, batch: Any, loss_of: Callable[[Any], Any]) -> None:
        """Runs `batch` under no_sync, again in halves of what runs out of memory: Note [Out of memory]."""
        parts = [(batch, micro.units)]
        while parts:
            part, units = parts.pop(0)
            backup = (GradientBackup(self.model.module), self._steps.window_backup()) if (
                self._may_run_out(units)) else None
            try:
                loss, weight, metrics = _loss_weight_metrics(loss_of(part))
                self._accumulate(loss, _weight(micro, weight, rows_of(part)), metrics, units)
                continue
            except torch.OutOfMemoryError:
                if backup is None or rows_of(part) < 2:
                    raise
            # Out of the except clause: its traceback no longer holds the failed part's activations.
            loss = None
            gradients, restore_window = backup
            gradients.restore()
            restore_window()
            self._memory.ran_out(units)
            first, second = halves(part)
            rows = rows_of(part)
            parts[:0] = [(first, units * rows_of(first) / rows), (second, units * rows_of(second) / rows)]

    def _step_done(self, step: int, stats: StepStats, reports_sent: bool = True) -> None:
        """Counts the completed `step`, and feeds the policy with the reports in its stats, if every rank sent one."""
        reports = self._codec.decode(stats.metrics) if reports_sent else None
        if reports is not None and any((r.step, r.epoch) != (reports[0].step, reports[0].epoch) for r in reports):
            self.model._drop_gradients()  # a sum over other global batches
            ran = ", ".join(f"rank {r} epoch {report.epoch} step {report.step}" for r, report in enumerate(reports))
            raise ValueError(f"hsync.Balancer: the ranks ran different steps as one: {ran}; a rank skipped a "
                             "micro-batch's backward (every micro-batch its sampler yields takes one, a bad one "
                             "too: the step is then skipped on every rank), or the ranks' Balancers were not "
                             "loaded from the same state (a checkpoint read on some ranks only?). The step's "
                             "gradients are dropped")
        if reports is not None:  # what the ranks reported is the step before this one
            self._policy.observe(step - 1, [r.busy_s for r in reports], [r.units for r in reports],
                                 full=self._measured_step_full)
            self.last_reports = reports
        self._previous = (stats, self._step_units)
        self._step_units, self._micro_batches_in_step = 0.0, 0
        self.last_plan, costs = self._split_steps.pop(step, ([], []))
        self.global_step += 1
        self._step_in_epoch += 1
        if self._step_in_epoch >= self.steps_per_epoch:
            self.epoch, self._step_in_epoch = self.epoch + 1, 0
        # An epoch's short last step would judge plans on its few examples: full ones decide, and only
        # their times, reported a step later, compare plans (its own still fit the cost models).
        full = len(costs) == min(self.config.global_batch_size, len(self._splitter.costs))
        self._measured_step_full = full
        if reports is not None and self._decides and full and self._policy.due(step):
            caps = [self._micro_cap(r) for r in range(self.world_size)]
            self._policy.decide(step, costs, max(r.split_through for r in reports), caps)

    @property
    def _decides(self) -> bool:
        """Whether the plan is measured and decided (not a fixed split, not one rank)."""
        return self.config.rank_batch_sizes is None and self.world_size > 1

    def _policy_config(self) -> PolicyConfig:
        c = self.config
        return PolicyConfig(self.world_size, c.warmup_steps, c.probe_steps, c.replan_every, c.min_gain)

    def _models_for(self, step: int) -> list[RankCost]:
        """The cost models that split `step`: the policy's (warm-up, probes, then the plans it adopts). Where no
        decision ever comes (a fixed split, one rank), each rank's micro-batches follow its memory as last
        measured, which nothing else would bring in; the shares do not depend on it."""
        if not self._decides:
            return [RankCost(0.0, 1.0, self._micro_cap(r)) for r in range(self.world_size)]
        return self._policy.models_for(step, [self._micro_cap(r, measured=False) for r in range(self.world_size)])

    @property
    def cost_models(self) -> list[RankCost] | None:
        """The ranks' cost models in force at the last step split, once measurements gave them."""
        return self._policy.plan_for(self._split_through) if self._decides else None

    @property
    def decisions(self) -> int:
        """How many times the measurements have been weighed (the first puts the equal split in force)."""
        return self._policy.decisions

    def fitted_costs(self) -> list[RankCost | None]:
        """Each rank's cost model as its measurements fit it now (None before it has any)."""
        lines = self._policy.fit()
        if lines is None:
            return [None] * self.world_size
        return [RankCost(float(f), float(p)) for f, p in zip(*lines, strict=True)]

    def planned_split(self) -> list[int]:
        """Examples per rank of a whole global batch of equal examples at the next step: the fixed split
        (rank_batch_sizes), or the one the cost models in force give."""
        batch = self.config.global_batch_size
        return [len(share) for share in self._splitter.split([1.0] * batch, self._models_for(self.global_step))]

    # -- memory ------------------------------------------------------------------------------------

    def _micro_cap(self, rank: int, measured: bool = True) -> float:
        """Units of work rank `rank` may run in one micro-batch: the configured limit, and on a GPU what its
        memory allows as it last reported, or, before that is known, an equal share. With cross_rank_backward
        only the limit: a share split by memory would break the ranks' lockstep (check_lockstep)."""
        cap = self._limits[rank]
        if self._memory is not None and not self.model.cross_rank_backward:
            capacity = self.last_reports[rank].capacity if measured and self.last_reports else 0.0
            cap = min(cap, capacity if capacity > 0 else self._equal_share_units)
        return cap

    def _capacity(self) -> float:
        """This rank's largest micro-batch in units by its memory (0: not known, or not bounded)."""
        return self._memory.capacity() if self._memory is not None else 0.0

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the loop is: the epoch and the steps completed in it, counted in global batches, so a run
        resumes at the next step whatever its world size; and the policy's plan and fits, which a resume on
        as many ranks goes on with (on another number, it measures its ranks anew). Plain values only."""
        state = {"epoch": self.epoch, "step_in_epoch": self._step_in_epoch, "global_step": self.global_step,
                 "seed": self.config.seed, "shuffle": self.config.shuffle, "drop_last": self.config.drop_last,
                 "global_batch_size": self.config.global_batch_size, "num_examples": len(self._splitter.costs)}
        if self._decides:
            state["policy"] = self._policy.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Goes on from `state` (state_dict()'s, on every rank the same: a rank loaded otherwise is named at the
        next step)."""
        config = self.config
        missing = [key for key in ("epoch", "step_in_epoch", "global_step", "seed", "global_batch_size",
                                   "num_examples") if key not in state]
        if missing:
            raise ValueError(f"hsync.Balancer: the state has no {', '.join(missing)}: not a Balancer's state_dict()")
        position = {key: state[key] for key in ("epoch", "step_in_epoch", "global_step")}
        if not (all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in position.values())
                and position["step_in_epoch"] < self.steps_per_epoch
                and position["global_step"] >= position["step_in_epoch"]):
            raise ValueError(f"hsync.Balancer: the state's position {position} is not one of this run's (epochs of "
                             f"{self.steps_per_epoch} steps)")
        # Older checkpoints lack these two: their runs shuffled and kept an epoch's last step.
        kept = {"shuffle": True, "drop_last": False, **state}
        for key, ours in (("num_examples", len(self._splitter.costs)), ("global_batch_size", config.global_batch_size),
                          ("seed", config.seed), ("shuffle", config.shuffle), ("drop_last", config.drop_last)):
            if kept[key] != ours:
                # A global batch derived from per-rank sizes changes with the number of ranks: say how to keep it.
                keep = "" if key != "global_batch_size" else (
                    f" (to go on with its global batches on these ranks, set global_batch_size={kept[key]}: "
                    "BalanceConfig's, or the integrations' BalancingArguments)")
                raise ValueError(f"hsync.Balancer: the checkpoint has {key} {kept[key]}, this run {ours}: "
                                 f"it was written for other data or another batch{keep}")
        self.epoch, self._step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = state["global_step"]
        self._policy = Policy(self._policy_config(), first_step=self.global_step)
        policy = state.get("policy")
        if policy is not None and policy["world_size"] == self.world_size and self._decides:
            self._policy.load_state_dict(policy, first_step=self.global_step)
        self._previous = None
        self._pending.clear()

    # -- set-up ------------------------------------------------------------------------------------

    def _micro_batch_limits(self) -> list[float]:
        limit, fixed = self.config.micro_batch_limit, self.config.rank_batch_sizes
        limits = list(limit) if isinstance(limit, Sequence) else [limit] * self.world_size
        if len(limits) != self.world_size or any(v is not None and not v > 0 for v in limits):
            raise ValueError(f"BalanceConfig.micro_batch_limit must be a positive number or one per rank "
                             f"({self.world_size}), got {limit!r}")
        if fixed is not None and len(fixed) != self.world_size:
            raise ValueError(f"BalanceConfig.rank_batch_sizes has {len(fixed)} sizes for {self.world_size} ranks")
        return [math.inf if v is None else float(v) for v in limits]

    def _check_same_everywhere(self, refusal: str | None) -> None:
        """Every rank must split the same steps of the same data: a difference, or a rank's refusal of its
        own arguments, is raised on every rank."""
        config, costs = self.config, self._splitter.costs
        mine = refusal if refusal is not None else {
            "the number of examples": len(costs), "the examples' costs (a digest)": _digest(costs),
            "global_batch_size": config.global_batch_size, "seed": config.seed, "shuffle": config.shuffle,
            "drop_last": config.drop_last, "the micro-batch limits": self._limits,
            "rank_batch_sizes": config.rank_batch_sizes and list(config.rank_batch_sizes),
            "replan_every": config.replan_every,
            "warmup_steps": config.warmup_steps, "probe_steps": config.probe_steps, "min_gain": config.min_gain,
            "measuring memory": self._memory is not None}
        everyone = Channels.of_model(self.model).gather_objects(mine, "the Balancer's settings")
        refused = [r for r, theirs in enumerate(everyone) if isinstance(theirs, str)]
        if refused:
            raise ValueError(f"{everyone[refused[0]]} (rank {refused[0]}; refused on ranks {refused})")
        different = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if different:
            raise SettingsDiffer(f"hsync.Balancer: ranks {different} were given other data or settings than rank 0: "
                                 f"{SettingsDiffer.describe(everyone, 0, different[0])}", everyone)


class SettingsDiffer(ValueError):
    """The ranks were given other data or settings; `settings` holds each rank's, as the Balancer compares them."""

    def __init__(self, message: str, settings: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.settings = settings

    @staticmethod
    def describe(settings: list[dict[str, Any]], reference: int, other: int) -> str:
        """What differs between rank `other`'s settings and rank `reference`'s."""
        theirs = settings[other]
        return "; ".join(f"{name} {value!r} on rank {reference}, {theirs[name]!r} on rank {other}"
                         for name, value in settings[reference].items() if theirs[name] != value)


def _example_costs(examples: int | Sequence[float]) -> list[float]:
    if isinstance(examples, numbers.Integral) and not isinstance(examples, bool):  # numpy's too
        if examples < 1:
            raise ValueError(f"hsync.Balancer needs at least one example, got {examples}")
        return [1.0] * int(examples)
    if isinstance(examples, numbers.Number | str | bytes):  # a float count, say
        raise ValueError(f"hsync.Balancer: examples must be the number of examples (an int) or one cost per example "
                         f"(their lengths), got {describe(examples)}")
    try:
        costs = [float(c) for c in examples]
    except (TypeError, ValueError):
        costs = []
    if not costs or any(not (c > 0) or math.isinf(c) for c in costs):
        raise ValueError("hsync.Balancer: example costs must be finite positive numbers (lengths), and "
                         "there must be at least one")
    return costs


def _weight(micro: MicroBatch, weight: float | torch.Tensor | None, examples: int) -> float | torch.Tensor:
    return 0.0 if micro.filler else (examples if weight is None else weight)


def _digest(costs: list[float]) -> str:
    """A fingerprint of the example costs: ranks given the same lengths in another order differ."""
    return hashlib.blake2b(array.array("d", costs).tobytes(), digest_size=8).hexdigest()


def _loss_weight_metrics(result) -> tuple[torch.Tensor, float | torch.Tensor | None, Mapping | None]:
    """What a forward_backward loss_of returned, as backward()'s arguments."""
    if isinstance(result, tuple):
        if len(result) != 3:
            raise TypeError(f"hsync.Balancer.forward_backward: loss_of must return a loss or (loss, weight, "
                            f"metrics), got a tuple of {len(result)}")
        return result
    return result, None, None
