"""hsync.Balancer in real training loops: exact gradients, every example once, resume, decisions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hsync.balance.clock import StepClock
from hsync.balance.simulate import SimulatedCost, SimulatedSlowdown
from tests.distributed.workloads import COMPILE_BACKEND, compiled_backward_nodes
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


class Numbers(Dataset):
    """Example i: a feature vector drawn from i, a target, and i itself."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(6, generator=g, dtype=torch.float64), torch.randn(1, generator=g, dtype=torch.float64), i


def stacked(data: Numbers, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and targets of these examples, as one batch."""
    return torch.stack([data[i][0] for i in indices]), torch.stack([data[i][1] for i in indices])


class Regression(nn.Module):
    """A small MLP. A class of the test's own: under torch.compile(wrapper), dynamo compiles the forward of a
    user's module after the wrapper's graph breaks, but not that of torch's own nn.Sequential. With a
    buffer, as BERT's position ids: rank 0's is broadcast once a step, however many micro-batches a rank runs."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 8)
        self.out = nn.Linear(8, 1)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x + self.shift)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Regression().double()


def gather_indices(indices: list[int]) -> list[int]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, indices)
    return sorted(i for part in everyone for i in part)


def each_example_once(rank, world_size, slowdown: float, lengths: bool):
    """A DataLoader with workers over the balancer, through epochs whose plans change (probe splits, then
    planned ones; with lengths, every step is split anew)."""
    import hsync

    size = 150
    model = hsync.WeightedDDP(make_model())
    costs = [float(1 + (i * 7) % 13) for i in range(size)] if lengths else size
    config = hsync.BalanceConfig(global_batch_size=16, replan_every=4, warmup_steps=1, probe_steps=1,
                                 micro_batch_limit=6 if lengths else None)
    balancer = hsync.Balancer(model, costs, config,
                              clock=SimulatedSlowdown(slowdown if rank == 1 else 1.0, model.device))
    loader = DataLoader(Numbers(size), batch_sampler=balancer, num_workers=2, pin_memory=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plans, epochs = set(), []
    for epoch in range(2):
        balancer.set_epoch(epoch)
        seen, step_seen = [], []
        for x, y, index in loader:
            step_seen += index.tolist()
            loss = nn.functional.mse_loss(model(x), y)
            if balancer.backward(loss) is not None:
                optimizer.step()
                optimizer.zero_grad()
                plans.add(tuple(balancer.last_plan))
                seen += step_seen
                step_seen = []
        assert not step_seen, "the epoch ended inside a step"
        epochs.append(gather_indices(seen))
    assert len(loader) == balancer.steps_per_epoch == 10, "len(loader) counts the epoch's steps"
    return epochs, sorted(plans), balancer.global_step


@pytest.mark.parametrize("lengths", [False, True], ids=["examples", "tokens"])
def test_every_example_once_per_epoch_with_a_dataloader_and_changing_plans(lengths):
    results = run_ranks(each_example_once, 2, 3.0, lengths, timeout=180)
    epochs, plans, steps = results[0]
    for seen in epochs:
        assert seen == list(range(150)), "every example exactly once per epoch, over all ranks"
    assert steps == 2 * 10 and results[1][2] == steps, "all ranks run the same steps: ceil(150 / 16) per epoch"
    assert len(plans) >= 3, f"the plans changed during the run: {plans}"


def exact_gradients(rank, world_size, lengths: bool, compiled: bool = False):
    """Per-rank accumulation counts (micro-batch limits 2 and 5 examples, a fixed uneven split, or
    token lengths with a token limit): the gradient of every step is the one of the whole global batch.
    Compiled: the balancer gets torch.compile(WeightedDDP(net)), as torch advises compiling a DDP."""
    import hsync

    size = 40
    data = Numbers(size)
    costs = [float(1 + i % 5) for i in range(size)] if lengths else size
    config = hsync.BalanceConfig(global_batch_size=16, rank_batch_sizes=None if lengths else [11, 5],
                                 micro_batch_limit=[6, 9] if lengths else [2, 5], seed=3)
    model = hsync.WeightedDDP(make_model())
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, backend=COMPILE_BACKEND)
    reference = make_model()
    balancer = hsync.Balancer(model, costs, config)
    micro_steps, step_indices = [], []
    count = 0
    for indices in balancer:
        x, y = stacked(data, indices)
        step_indices += indices
        count += 1
        # Token mode: the loss is a mean over "tokens" (each example's squared error counted length times).
        w = torch.tensor([costs[i] for i in indices], dtype=torch.float64) if lengths else torch.ones(len(indices))
        loss = ((model(x) - y).pow(2).squeeze(1) * w).sum() / w.sum()
        assert compiled_backward_nodes(loss) == int(compiled), "compiled graphs run if, and only if, compiled"
        stats = balancer.backward(loss, weight=w.sum() if lengths else None)
        if stats is None:
            continue
        everything = gather_indices(step_indices)
        micro_steps.append(count)
        count, step_indices = 0, []
        rx, ry = stacked(data, everything)
        rw = torch.tensor([costs[i] for i in everything], dtype=torch.float64) if lengths else torch.ones(len(rx))
        reference.zero_grad()
        (((reference(rx) - ry).pow(2).squeeze(1) * rw).sum() / rw.sum()).backward()
        for ours, theirs in zip(model.module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            for ours, theirs in zip(model.module.parameters(), reference.parameters(), strict=True):
                ours -= 0.1 * ours.grad
                theirs -= 0.1 * theirs.grad
        model.zero_grad()
    return micro_steps


@pytest.mark.parametrize(("lengths", "compiled"), [(False, False), (True, False), (False, True)],
                         ids=["examples", "tokens", "examples-compiled"])
def test_gradients_are_exact_with_per_rank_accumulation_counts(lengths, compiled):
    micro_steps = run_ranks(exact_gradients, 2, lengths, compiled, timeout=180)
    assert len(micro_steps[0]) == len(micro_steps[1]) == 3, "ceil(40 / 16) steps on every rank"
    if not lengths:
        # 11 examples by 2 and 5 examples by 5; the last step's 8 split 6 + 2 (largest remainders of 11:5).
        assert micro_steps == [[6, 6, 3], [1, 1, 1]]
    else:
        assert micro_steps[0] != micro_steps[1], "the ranks ran different numbers of micro-batches"


def train(model, balancer, optimizer, steps: int) -> None:
    data = Numbers(balancer.state_dict()["num_examples"])
    done = 0
    while done < steps:
        for indices in balancer:
            x, y = stacked(data, indices)
            loss = nn.functional.mse_loss(model(x), y)
            if balancer.backward(loss) is not None:
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == steps:
                    return


def resume(rank, world_size):
    """Ten steps in one go against six, a checkpoint, and four more in a fresh model, optimizer and
    balancer (whose plan differs: it probes anew), with a slow rank 1 so that plans move."""
    import hsync

    def fresh():
        model = hsync.WeightedDDP(make_model())
        config = hsync.BalanceConfig(global_batch_size=12, warmup_steps=0, probe_steps=1, replan_every=2)
        balancer = hsync.Balancer(model, 30, config, clock=SimulatedSlowdown(2.0 if rank == 1 else 1.0, model.device))
        return model, balancer, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, balancer, optimizer = fresh()
    train(model, balancer, optimizer, 10)
    uninterrupted = [p.detach().clone() for p in model.module.parameters()]

    model, balancer, optimizer = fresh()
    train(model, balancer, optimizer, 6)
    saved = copy.deepcopy({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                           "balancer": balancer.state_dict()})
    model, balancer, optimizer = fresh()
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    balancer.load_state_dict(saved["balancer"])
    assert (balancer.epoch, balancer.global_step) == (2, 6), "30 examples by 12: three steps an epoch"
    train(model, balancer, optimizer, 4)
    for ours, theirs in zip(model.module.parameters(), uninterrupted, strict=True):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-12, atol=1e-14)
    return balancer.global_step


def test_resumed_run_makes_the_same_updates():
    assert run_ranks(resume, 2, timeout=120) == [10, 10]


class KnownCosts(StepClock):
    """Busy times from a known cost model instead of the clock, with noise: decisions become checkable."""

    def __init__(self, fixed: list[float], per_unit: list[float], noise: float) -> None:
        self.fixed, self.per_unit, self.noise = fixed, per_unit, noise
        self.g = torch.Generator().manual_seed(dist.get_rank())

    def step_seconds(self, stats, units: float) -> float:
        r = dist.get_rank()
        jitter = 1 + self.noise * (2 * torch.rand((), generator=self.g).item() - 1)
        return (self.fixed[r] + units * self.per_unit[r]) * jitter


def decisions(rank, world_size, fixed, per_unit, noise, epochs=8, state=None):
    """The plan of each step (and the balancer's state at the end), from `state` if given."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 64 * 8, hsync.BalanceConfig(global_batch_size=64, replan_every=10),
                              clock=KnownCosts(fixed, per_unit, noise))
    if state is not None:
        balancer.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    plans = []
    data = Numbers(64 * 8)
    for epoch in range(balancer.epoch, epochs):
        balancer.set_epoch(epoch)
        for indices in balancer:
            x, y = stacked(data, indices)
            if balancer.backward(nn.functional.mse_loss(model(x), y)):
                optimizer.step()
                plans.append(balancer.last_plan)
    return plans, balancer.state_dict(), balancer.planned_split()


def resumed_decisions(rank, world_size, fixed, per_unit, noise):
    """Four epochs, a checkpoint of the balancer (through torch.save and weights_only), four more."""
    import io

    before, state, planned = decisions(rank, world_size, fixed, per_unit, noise, epochs=4)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    after, _, _ = decisions(rank, world_size, fixed, per_unit, noise, state=torch.load(buffer, weights_only=True))
    return before, planned, after


def test_decisions_reach_the_loop_through_the_step_scalars():
    # The policy's arithmetic is tested in tests/unit/test_policy.py; here, that the measurements travel in
    # the step's scalars and every rank adopts the same plan at the same step. Rank 1 is twice as slow,
    # and rank 0 pays a fixed 8 units more per step: 41 + 23 and 40 + 24 both take 0.49 s, the optimum.
    # Steps 0-1 warm up, 2-10 probe, 12-21 measure the equal split, the plan applies from step 22.
    (plans, _, planned), (plans_1, _, _) = run_ranks(decisions, 2, [0.08, 0.01], [0.01, 0.02], 0.02, timeout=240)
    assert plans == plans_1, "every rank split every step alike"
    assert len(plans) == 64 and plans[12:22] == [[32, 32]] * 10, plans
    assert all(p in ([41, 23], [40, 24]) for p in plans[22:]), plans
    assert planned == plans[-1], "planned_split() is the split in force"


def test_a_resume_goes_on_with_the_plan_and_fits_instead_of_probing():
    (before, planned, after), _ = run_ranks(resumed_decisions, 2, [0.08, 0.01], [0.01, 0.02], 0.02, timeout=240)
    assert before[-1] in ([41, 23], [40, 24]) and planned == before[-1], before
    assert len(after) == 32 and all(p == before[-1] for p in after), after


class TellsUnits(SimulatedCost):
    """A simulated cost that keeps what each step told it: the step's units of work on this rank."""

    def __init__(self, fixed_s: float, per_unit_s: float) -> None:
        super().__init__(fixed_s, per_unit_s)
        self.told: list[float] = []

    def own_work_done(self, busy_so_far, units: float) -> None:
        self.told.append(units)
        super().own_work_done(busy_so_far, units)


def simulated_costs(rank, world_size):
    """Rank 1 costs 5 ms per step and 20 ms per example more than rank 0 (far above what a loaded machine's noise
    adds to either): the units each step held, as the clock was told them, and what the ranks reported as busy,
    beside the split."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    clock = TellsUnits(0.005, 0.020) if rank == 1 else TellsUnits(0.0, 0.0)
    config = hsync.BalanceConfig(global_batch_size=12, warmup_steps=1, probe_steps=1, replan_every=3)
    balancer = hsync.Balancer(model, 60, config, clock=clock)
    splits, busy = [], []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        train(model, balancer, optimizer, 1)
        splits.append(balancer.last_plan)
    for _ in range(18):  # warm-up and probes to step 4, the equal split measured to step 7, then plans
        train(model, balancer, optimizer, 1)
        splits.append(balancer.last_plan)
        busy.append([report.busy_s for report in balancer.last_reports])  # of the step before
    return clock.told, splits, busy


def test_a_clock_is_told_each_steps_units_and_a_simulated_cost_counts_as_busy():
    (told_0, splits, busy), (told_1, _, _) = run_ranks(simulated_costs, 2, timeout=120)
    assert told_0 == [split[0] for split in splits] and told_1 == [split[1] for split in splits], (told_0, splits)
    for before, (_, slept) in zip(splits[1:], busy, strict=False):  # rank 1's report is of the step before
        assert slept >= 0.005 + 0.020 * before[1], (before, slept)
    assert splits[-1][0] > splits[-1][1], "the costly rank gets fewer examples"


class SimulatedMemory:
    """A device of `total` bytes on which a micro-batch of n units peaks at base + n * per_unit bytes, read
    by the balancer as it reads a GPU's; a micro-batch that does not fit fails as it would there."""

    def __init__(self, total: float, base: float, per_unit: float) -> None:
        self.total, self.base, self.per_unit = total, base, per_unit
        self.peak = base
        self.failures = 0

    def run(self, units: int) -> None:
        needed = self.base + units * self.per_unit
        if needed > self.total:
            self.failures += 1
            raise torch.OutOfMemoryError(f"a micro-batch of {units} units needs {needed:.0f} of {self.total:.0f} bytes")
        self.peak = max(self.peak, needed)

    def budget_bytes(self, fraction: float) -> float:
        return fraction * self.total

    def take_peak_bytes(self) -> int:
        peak, self.peak = self.peak, self.base
        return int(peak)


def memory_bounded(rank, world_size, units_that_fit: list[float], fixed: bool = False):
    """Rank 0 three times as fast as rank 1 (the optimum of 64 examples: 48 + 16), each rank's memory
    holding `units_that_fit` examples in one micro-batch at BalanceConfig's memory_fraction of 0.9. The
    balancer learns from the measured peaks what fits, as on a GPU: (plans, micro-batches per step, and
    the largest micro-batch this rank ran once the plan is in force)."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    base, per_unit = 1e6, 1e4
    memory = SimulatedMemory((base + units_that_fit[rank] * per_unit) / 0.9, base, per_unit)
    balancer = hsync.Balancer(model, 64 * 8, hsync.BalanceConfig(global_batch_size=64, replan_every=10,
                                                                 rank_batch_sizes=[48, 16] if fixed else None),
                              clock=KnownCosts([0.01, 0.01], [0.01, 0.03], 0.02), memory=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    plans, micro_counts, largest = [], [], 0
    data = Numbers(64 * 8)
    count = 0
    for epoch in range(8):
        balancer.set_epoch(epoch)
        for indices in balancer:
            memory.run(len(indices))
            count += 1
            if len(plans) >= 22:
                largest = max(largest, len(indices))
            x, y = stacked(data, indices)
            if balancer.backward(nn.functional.mse_loss(model(x), y)):
                optimizer.step()
                plans.append(balancer.last_plan)
                micro_counts.append(count)
                count = 0
    return plans, micro_counts, largest


@pytest.mark.parametrize("fixed", [False, True], ids=["measured-split", "fixed-split"])
@pytest.mark.parametrize(("fits", "micro_batches", "largest"), [
    (40.0, 2, 40),  # memory for less than its share: the share runs as 40 + 8 (or 39 + 9: rounding)
    (60.0, 1, 48),  # for more than an equal share: the whole share at once, once measured
], ids=["small-memory", "large-memory"])
def test_a_fast_rank_gets_its_share_in_micro_batches_its_memory_holds(fits, micro_batches, largest, fixed):
    # Before any measurement a micro-batch holds at most an equal share (32): the probe splits' shares of
    # 48 (or a fixed split's) run as 32 + 16, and their peaks give each rank's fit of memory against units.
    results = run_ranks(memory_bounded, 2, [fits, 1000.0], fixed, timeout=240)
    (plans, counts, biggest), (_, slow_counts, _) = results
    assert len(plans) == 64 and all(p == [48, 16] for p in plans[22:]), plans
    assert counts[22:] == [micro_batches] * 42 and largest - 1 <= biggest <= largest, (counts, biggest)
    assert slow_counts[22:] == [1] * 42, "the slow rank's 16 fit in one micro-batch"


def runs_out_of_memory(rank, world_size, fits: list[float], where: str):
    """A fixed split of 32 + 32 examples; rank r's device holds `fits[r]` units in one micro-batch, and one too
    large runs out of memory in its forward, or in its backward once the output layer's gradients have
    accumulated: (the parameters after three epochs, the micro-batch sizes of each step, the failures,
    the capacities every rank plans with)."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    base, per_unit = 1e6, 1e4
    memory = SimulatedMemory(base + fits[rank] * per_unit, base, per_unit)
    balancer = hsync.Balancer(model, 64 * 3, hsync.BalanceConfig(global_batch_size=64, rank_batch_sizes=[32, 32]),
                              memory=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Numbers(64 * 3)
    if where == "backward":
        def fail_in_backward(module, inputs) -> None:
            inputs[0].register_hook(lambda grad: memory.run(len(grad)))

        model.module.out.register_forward_pre_hook(fail_in_backward)

    def loss_of(batch):
        x, y = batch
        if where == "forward":
            memory.run(len(x))
        return nn.functional.mse_loss(model(x), y)

    sizes, step_sizes = [], []
    for epoch in range(3):
        balancer.set_epoch(epoch)
        for indices in balancer:
            step_sizes.append(len(indices))
            stats = balancer.forward_backward(stacked(data, indices), loss_of)
            if stats is not None:
                assert stats.finite and stats.weight == 64
                optimizer.step()
                optimizer.zero_grad()
                sizes.append(step_sizes)
                step_sizes = []
    capacities = [report.capacity for report in balancer.last_reports]
    return [p.detach() for p in model.module.parameters()], sizes, memory.failures, capacities


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_micro_batch_that_runs_out_of_memory_runs_again_in_halves(where):
    # Before measurements a micro-batch holds an equal share (32), too much for rank 0's 20: it fails once,
    # runs as 16 + 16 with the gradients of one piece, and every later step cuts rank 0's share smaller
    # still (its measured peaks leave room for 8 at BalanceConfig's memory_fraction of 0.9).
    (params, sizes, failures, capacities), (_, sizes_1, failures_1, capacities_1) = run_ranks(
        runs_out_of_memory, 2, [20.0, 1000.0], where, timeout=120)
    reference = run_ranks(runs_out_of_memory, 2, [1000.0, 1000.0], where, timeout=120)[0][0]
    for ours, theirs in zip(params, reference, strict=True):  # nothing lost, nothing twice
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert (failures, failures_1) == (1, 0)
    assert sizes[0] == [32] and sizes_1 == [[32]] * 9, (sizes, sizes_1)
    assert all(sum(step) == 32 and max(step) <= 16 for step in sizes[1:]), sizes
    assert sizes[-1] == [8, 8, 8, 8], sizes
    assert capacities == capacities_1, "every rank plans with the same caps"


def unfreezing_near_the_memory_limit(rank, world_size, fits: list[float]):
    """A fixed split of 32 + 32 examples, the hidden layer frozen at wrap time and unfrozen after four steps, when
    a micro-batch's memory per example doubles (the layer's activations are kept for its gradient now): rank 0's
    32, which fit before, run out of memory then. (The parameters after two epochs, the failures.)"""
    import hsync

    model_module = make_model()
    model_module.hidden.requires_grad_(False)
    model = hsync.WeightedDDP(model_module)
    base, per_unit = 1e6, 1e4
    memory = SimulatedMemory((base + fits[rank] * per_unit) / 0.9, base, per_unit)
    balancer = hsync.Balancer(model, 64 * 4, hsync.BalanceConfig(global_batch_size=64, rank_batch_sizes=[32, 32]),
                              memory=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Numbers(64 * 4)

    def loss_of(batch):
        x, y = batch
        memory.run(len(x))
        return nn.functional.mse_loss(model(x), y)

    for epoch in range(2):
        balancer.set_epoch(epoch)
        for indices in balancer:
            if balancer.global_step == 4 and model_module.hidden.weight.requires_grad is False:
                model_module.hidden.requires_grad_(True)
                assert model.refresh_trainable_parameters()
                memory.per_unit *= 2
            if balancer.forward_backward(stacked(data, indices), loss_of) is not None:
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach() for p in model.module.parameters()], memory.failures


def test_a_micro_batch_that_fit_before_parameters_were_unfrozen_runs_again_in_halves_if_it_no_longer_does():
    # The Balancer forgets the peaks it measured with the layer frozen: rank 0's 32 run with a way back, once.
    (params, failures), (_, failures_1) = run_ranks(unfreezing_near_the_memory_limit, 2, [40.0, 1000.0])
    reference = run_ranks(unfreezing_near_the_memory_limit, 2, [1000.0, 1000.0])[0][0]
    for ours, theirs in zip(params, reference, strict=True):  # nothing lost, nothing twice
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert (failures, failures_1) == (1, 0)


def micro_batches_of_an_epoch(rank, world_size):
    """Without a backward, the sampler splits a whole epoch: (each rank's micro-batches with a fixed split
    of examples with lengths; the first step's micro-batch sizes on a GPU before memory is measured)."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    lengths = [float(1 + (7 * i) % 10) for i in range(40)]
    fixed = hsync.Balancer(model, lengths, hsync.BalanceConfig(global_batch_size=16, rank_batch_sizes=[11, 5],
                                                               micro_batch_limit=20, seed=1))
    batches = [[lengths[i] for i in indices] for indices in fixed]
    assert gather_indices([i for indices in fixed for i in indices]) == list(range(40)), "every example once"
    assert fixed.planned_split() == [11, 5], "the split that runs, not an equal one"
    # As on a GPU: an equal share before measurements.
    unmeasured = hsync.Balancer(model, 63, hsync.BalanceConfig(global_batch_size=63),
                                memory=SimulatedMemory(1e12, 0.0, 1.0))
    sizes = [len(indices) for indices in unmeasured]
    first_step = [n for n, micro in zip(sizes, unmeasured._pending, strict=True) if micro.step == 0]
    return batches, first_step


def epoch_with_a_filler(rank, world_size):
    """17 examples by 16: the epoch's last step has one example, and the other rank runs a filler."""
    import hsync

    model = hsync.WeightedDDP(make_model(), metric_names=("examples",))
    balancer = hsync.Balancer(model, 17, hsync.BalanceConfig(global_batch_size=16, seed=5))
    data = Numbers(17)
    steps = []
    for indices in balancer:
        x, y = stacked(data, indices)
        examples = 0 if balancer.filler else len(indices)
        stats = balancer.backward(nn.functional.mse_loss(model(x), y), metrics={"examples": examples})
        if stats is not None:
            steps.append((stats.weight, stats.metrics["examples"]))
    return steps


def test_a_filler_micro_batch_adds_nothing_to_the_step():
    # Its example is the other rank's: its weight is 0, and Balancer.filler tells the loop to skip its counts.
    assert run_ranks(epoch_with_a_filler, 2, timeout=60) == [[(16, 16), (1, 1)]] * 2


def a_backward_fails(rank, world_size):
    """Rank 1's backward raises on its last micro-batch of step 1 (out of memory, say); the loop goes on."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 40, hsync.BalanceConfig(global_batch_size=16, micro_batch_limit=5, seed=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Numbers(40)
    epochs, finite = [], []

    def fail(grad):
        raise RuntimeError("simulated failure")

    for epoch in range(balancer.epoch, 3):
        balancer.set_epoch(epoch)
        seen = []
        for indices in balancer:
            seen += indices
            x, y = stacked(data, indices)
            loss = nn.functional.mse_loss(model(x), y)
            if rank == 1 and balancer.global_step == 1 and balancer._pending[0].last:
                loss.register_hook(fail)
            try:
                stats = balancer.backward(loss)
            except RuntimeError as error:
                assert "simulated failure" in str(error)
                finite.append(None)
                optimizer.zero_grad()
                continue
            if stats is not None:
                finite.append(stats.finite)
                if stats.finite:
                    optimizer.step()
                optimizer.zero_grad()
        epochs.append(gather_indices(seen))
    return epochs, finite, balancer.global_step


def test_a_backward_that_fails_on_one_rank_leaves_the_balancer_in_step():
    (epochs, finite, steps), (epochs_1, finite_1, steps_1) = run_ranks(a_backward_fails, 2, timeout=120)
    assert steps == steps_1 == 9, "three steps an epoch on both ranks"
    assert epochs == epochs_1 == [list(range(40))] * 3, "every example once per epoch, the failed step's too"
    assert finite == [True, False] + [True] * 7 and finite_1 == [True, None] + [True] * 7


def test_micro_batches_keep_to_their_cap():
    for rank, (batches, first_step) in enumerate(run_ranks(micro_batches_of_an_epoch, 2, timeout=60)):
        for costs in batches:  # longest first, as a fixed split's share is ordered too
            assert len(costs) == 1 or len(costs) * max(costs) <= 20, f"rank {rank}: {costs} pads beyond 20"
        # 63 by 2: 32 and 31 examples, each in one micro-batch (an equal share rounded up).
        assert first_step == [[32], [31]][rank]


def refused_on_every_rank(rank, world_size):
    import hsync

    model = hsync.WeightedDDP(make_model())
    with pytest.raises(ValueError, match=r"ranks \[1\] were given other data or settings than rank 0: the number of "
                                         r"examples 100 on rank 0, 99 on rank 1; the examples' costs"):
        hsync.Balancer(model, 100 if rank == 0 else 99, hsync.BalanceConfig(global_batch_size=8))
    with pytest.raises(ValueError, match=r"were given other data or settings than rank 0: global_batch_size 8 on "
                                         r"rank 0, 12 on rank 1$"):  # was two tuples of thirteen unnamed values
        hsync.Balancer(model, 100, hsync.BalanceConfig(global_batch_size=8 + 4 * rank))
    with pytest.raises(ValueError, match=r"at least one example, got 0 \(rank 1; refused on ranks \[1\]\)"):
        hsync.Balancer(model, 100 if rank == 0 else 0, hsync.BalanceConfig(global_batch_size=8))
    lengths = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"ranks \[1\] were given other data or settings than rank 0"):
        hsync.Balancer(model, lengths if rank == 0 else lengths[::-1], hsync.BalanceConfig(global_batch_size=2))
    with pytest.raises(ValueError, match="has 3 sizes for 2 ranks"):
        hsync.Balancer(model, 100, hsync.BalanceConfig(global_batch_size=9, rank_batch_sizes=[3, 3, 3]))
    balancer = hsync.Balancer(model, 100, hsync.BalanceConfig(global_batch_size=8))
    with pytest.raises(RuntimeError, match="no micro-batch of this balancer is waiting"):
        balancer.backward(model(torch.zeros(1, 6, dtype=torch.float64)).sum())
    with pytest.raises(ValueError, match="written for other data"):
        balancer.load_state_dict({**balancer.state_dict(), "num_examples": 7})
    with pytest.raises(ValueError, match=r"the checkpoint has global_batch_size 16, this run 8: .* set "
                                         r"global_batch_size=16: BalanceConfig's, or the integrations'"):
        balancer.load_state_dict({**balancer.state_dict(), "global_batch_size": 16})
    with pytest.raises(ValueError, match="the checkpoint has shuffle False, this run True"):
        balancer.load_state_dict({**balancer.state_dict(), "shuffle": False})
    with pytest.raises(ValueError, match="the checkpoint has drop_last True, this run False"):
        balancer.load_state_dict({**balancer.state_dict(), "drop_last": True})
    with pytest.raises(ValueError, match=r"drop_last leaves no step of 8 examples in an epoch of 7 \(rank 0; refused "
                                         r"on ranks \[0, 1\]\)"):
        hsync.Balancer(model, 7, hsync.BalanceConfig(global_batch_size=8, drop_last=True))
    assert hsync.Balancer(model, 100, hsync.BalanceConfig(global_batch_size=8, drop_last=True)).steps_per_epoch == 12
    return True


def balancer_under_join(rank, world_size):
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 20, hsync.BalanceConfig(global_batch_size=8, rank_batch_sizes=[6, 2],
                                                             micro_batch_limit=2))
    with model.join():
        for indices in balancer:  # rank 0 would run three micro-batches a step, rank 1 one: three forwards to one
            x = torch.randn(len(indices), 6, dtype=torch.float64)
            with pytest.raises(RuntimeError, match=r"hsync.Balancer does not run under model.join\(\), and needs no "
                                                   "Join: every rank runs every step"):
                balancer.backward(model(x).sum())
            return True


def test_a_balancer_under_join_is_refused_on_every_rank_before_its_collectives():
    assert run_ranks(balancer_under_join, 2, timeout=60) == [True, True]


def test_different_data_or_settings_are_refused_on_every_rank():
    assert run_ranks(refused_on_every_rank, 2, timeout=60) == [True, True]


def loaded_otherwise_on_one_rank(rank, world_size):
    """Rank 1 loads a state two steps ahead of rank 0's (a stale checkpoint read on one node)."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 30, hsync.BalanceConfig(global_batch_size=12))
    state = balancer.state_dict()
    if rank == 1:
        state = {**state, "global_step": 2, "step_in_epoch": 2}
    balancer.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"the ranks ran different steps as one: rank 0 epoch 0 step 0, rank 1 "
                                         r"epoch 0 step 2; .* or the ranks' Balancers were not loaded from the same "
                                         r"state"):
        train(model, balancer, optimizer, 1)
    assert all(p.grad is None for p in model.module.parameters()), "the step's gradients mix two global batches"
    return True


def test_a_balancer_state_loaded_otherwise_on_one_rank_is_named_at_the_next_step_on_every_rank():
    # Each rank had gone on with steps of other global batches, reduced together, without a word.
    assert run_ranks(loaded_otherwise_on_one_rank, 2, timeout=60) == [True, True]


def a_micro_batch_skipped_on_one_rank(rank, world_size):
    """Rank 1 skips one micro-batch's backward (`if not torch.isfinite(loss): continue`): its later micro-batches
    each take the slot of the one before, with the same step numbers as rank 0's, until its epoch ends a step
    late. The next epoch's first step then meets rank 0's last of the epoch before."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 30, hsync.BalanceConfig(global_batch_size=6, rank_batch_sizes=[3, 3]))
    data = Numbers(30)
    steps = 0
    for epoch in range(2):
        balancer.set_epoch(epoch)
        for i, indices in enumerate(balancer):
            if rank == 1 and epoch == 0 and i == 2:
                continue
            x, y = stacked(data, indices)
            try:
                stats = balancer.backward(nn.functional.mse_loss(model(x), y))
            except ValueError as error:
                return steps, str(error)
            steps += stats is not None
    return steps, None


def test_a_micro_batch_skipped_on_one_rank_is_named_on_every_rank_when_the_epochs_part():
    # Was silent: every later step paired the ranks' shares of different global batches.
    for steps, error in run_ranks(a_micro_batch_skipped_on_one_rank, 2, timeout=60):
        assert steps == 4, steps
        assert error.startswith("hsync.Balancer: the ranks ran different steps as one: rank 0 epoch 0 step 4, "
                                "rank 1 epoch 1 step 4; a rank skipped a micro-batch's backward"), error


def steps_of_the_loops_own(rank, world_size, how: str):
    """A loop that takes the balancer as its sampler but keeps DDP's loss.backward(), or calls model.backward()."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 24, hsync.BalanceConfig(global_batch_size=6, rank_batch_sizes=[4, 2]))
    data = Numbers(24)
    taken = 0
    try:
        for indices in balancer:
            x, y = stacked(data, indices)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward() if how == "plain" else model.backward(loss, weight=len(indices))
            taken += 1
    except RuntimeError as error:
        return taken, str(error)
    return taken, None


@pytest.mark.parametrize("how", ["plain", "weighted"])
def test_steps_of_the_loops_own_on_a_balancers_micro_batches_are_refused(how):
    # Were taken: shares of 4 and 2 examples weighted alike (plain), and no plan ever measured.
    for taken, error in run_ranks(steps_of_the_loops_own, 2, how, timeout=60):
        assert taken == 1, taken
        assert error.startswith("hsync.Balancer: the model took a synchronised step of the loop's own "
                                "(loss.backward() or model.backward())"), error


def every_backward_inside_no_sync(rank, world_size):
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 24, hsync.BalanceConfig(global_batch_size=6, rank_batch_sizes=[4, 2],
                                                             micro_batch_limit=2))
    data = Numbers(24)
    taken = 0
    for indices in balancer:
        x, y = stacked(data, indices)
        with model.no_sync():  # DDP's accumulation kept around the balancer's backward
            try:
                balancer.backward(nn.functional.mse_loss(model(x), y))
            except RuntimeError as error:
                return taken, str(error)
        taken += 1
    return taken, None


def test_a_step_ending_backward_inside_no_sync_is_refused_before_its_collectives():
    # Was an AttributeError out of the balancer (the step's backward accumulated and returned no stats).
    for rank, (taken, error) in enumerate(run_ranks(every_backward_inside_no_sync, 2, timeout=60)):
        assert taken == [1, 0][rank], taken  # rank 0's first of two micro-batches accumulates, as it would anyway
        assert error.startswith("hsync.Balancer.backward: called inside the model's no_sync() on this rank's last "
                                "micro-batch of the step"), error


def a_bad_weight_through_a_balancer(rank, world_size):
    """Rank 1 passes a negative weight at the second step: the step is refused on every rank, saying why, and
    training goes on in step."""
    import hsync

    model = hsync.WeightedDDP(make_model())
    balancer = hsync.Balancer(model, 24, hsync.BalanceConfig(global_batch_size=6))
    data = Numbers(24)
    errors, finite = [], []
    for step, indices in enumerate(balancer):
        x, y = stacked(data, indices)
        try:
            weight = -1 if (rank, step) == (1, 1) else None
            stats = balancer.backward(nn.functional.mse_loss(model(x), y), weight=weight)
        except ValueError as error:
            errors.append((step, str(error)))
            continue
        finite.append(stats.finite)
    return errors, finite, balancer.global_step


def test_a_bad_weight_through_a_balancer_is_named_as_it_is_without_one():
    # The balancer's own check of the step's reports used to hide it ("the ranks ran different steps as one").
    for errors, finite, steps in run_ranks(a_bad_weight_through_a_balancer, 2, timeout=60):
        assert [step for step, _ in errors] == [1], errors
        assert "rank 1 passed a weight that is negative, NaN, infinite or above 2**53" in errors[0][1], errors
        assert (finite, steps) == ([True, True, True], 4)


def a_float_count(rank, world_size):
    import hsync

    try:
        hsync.Balancer(hsync.WeightedDDP(make_model()), 40.0, hsync.BalanceConfig(global_batch_size=8))
    except ValueError as error:
        return str(error)


def test_a_count_of_examples_that_is_not_an_integer_is_named():
    assert run_ranks(a_float_count, 1) == [
        "hsync.Balancer: examples must be the number of examples (an int) or one cost per example (their lengths), "
        "got float 40.0 (rank 0; refused on ranks [0])"]


def refused_states(rank, world_size):
    import hsync

    balancer = hsync.Balancer(hsync.WeightedDDP(make_model()), 30, hsync.BalanceConfig(global_batch_size=12))
    state = balancer.state_dict()
    refusals = []
    for bad in ({"epoch": -3}, {"step_in_epoch": 3}, {"global_step": 1, "step_in_epoch": 2}, {"epoch": 1.0},
                {"num_examples": None}):
        try:
            balancer.load_state_dict({key: value for key, value in {**state, **bad}.items() if value is not None})
        except ValueError as error:
            refusals.append(str(error))
    assert (balancer.epoch, balancer.global_step) == (0, 0), "a refused state changes nothing"
    return refusals


def test_a_state_that_is_no_position_of_this_run_is_refused():
    # -3 trained five epochs where two were asked; step 3 of an epoch of 3 steps skipped that epoch.
    position = "is not one of this run's (epochs of 3 steps)"
    assert run_ranks(refused_states, 1) == [[
        f"hsync.Balancer: the state's position {{'epoch': -3, 'step_in_epoch': 0, 'global_step': 0}} {position}",
        f"hsync.Balancer: the state's position {{'epoch': 0, 'step_in_epoch': 3, 'global_step': 0}} {position}",
        f"hsync.Balancer: the state's position {{'epoch': 0, 'step_in_epoch': 2, 'global_step': 1}} {position}",
        f"hsync.Balancer: the state's position {{'epoch': 1.0, 'step_in_epoch': 0, 'global_step': 0}} {position}",
        "hsync.Balancer: the state has no num_examples: not a Balancer's state_dict()"]]


@pytest.mark.parametrize(("fields", "message"), [
    ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1"),
    ({"global_batch_size": 8, "rank_batch_sizes": [4, 3]}, "adding up to global_batch_size 8"),
    ({"global_batch_size": 8, "min_gain": 1.5}, "min_gain must be in"),
    ({"global_batch_size": 8, "replan_every": 0}, "replan_every must be an integer >= 1"),
    ({"global_batch_size": 8, "memory_fraction": 0}, "memory_fraction must be in"),
    ({"global_batch_size": 8, "seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"global_batch_size": 8, "seed": "0"}, "seed must be an integer, got '0'"),
    ({"global_batch_size": 8, "shuffle": "no"}, "shuffle must be True or False, got 'no'"),
    ({"global_batch_size": 8, "drop_last": 1}, "drop_last must be True or False, got 1"),
    # Each of these three was a TypeError naming no setting, from a comparison deep inside.
    ({"global_batch_size": 8, "min_gain": "0.1"}, "min_gain must be a number, got '0.1'"),
    ({"global_batch_size": 8, "micro_batch_limit": "16"}, "micro_batch_limit must be None, a positive number or "
                                                         "one per rank, got '16'"),
    ({"global_batch_size": 8, "micro_batch_limit": [4, -1]}, "micro_batch_limit must be None, a positive"),
])
def test_nonsense_settings_are_refused(fields, message):
    import hsync

    with pytest.raises(ValueError, match=message):
        hsync.BalanceConfig(**fields)


def test_numpys_integers_are_taken_as_pythons():
    import numpy as np

    import hsync

    config = hsync.BalanceConfig(global_batch_size=np.int64(8), rank_batch_sizes=np.array([5, 3]), seed=np.int32(1))
    assert (config.global_batch_size, config.rank_batch_sizes, config.seed) == (8, [5, 3], 1)
    assert all(type(n) is int for n in (config.global_batch_size, *config.rank_batch_sizes, config.seed))


def balancer_given_a_dict(rank: int, world_size: int) -> str:
    import hsync

    model = hsync.WeightedDDP(nn.Linear(2, 1))
    with pytest.raises(TypeError, match="hsync.Balancer takes an hsync.BalanceConfig, got dict"):
        hsync.Balancer(model, 16, {"global_batch_size": 8})  # was an AttributeError on micro_batch_limit
    return "refused"


def test_a_config_that_is_no_balance_config_is_refused():
    assert run_ranks(balancer_given_a_dict, 2) == ["refused", "refused"]
