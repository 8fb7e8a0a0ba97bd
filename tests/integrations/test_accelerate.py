"""hsync.integrations.accelerate.Accelerator on two real ranks (gloo): Accelerate's own loop (prepare,
accumulate, backward, the prepared optimizer and scheduler) against one process over the same global
batches; save_state / load_state; gather_for_metrics over an evaluation loader prepared as usual."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests import integrations
from tests.integrations import LAUNCH_ENV as ENV
from tests.integrations import assert_near_float32
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed
pytest.importorskip("accelerate")

EXAMPLES, GLOBAL_BATCH, MICRO_LIMIT, EPOCHS, LR = 96, 32, 8, 2, 0.1
MOMENTUM, CLIP = 0.9, 0.5


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(EXAMPLES, 6, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin(), torch.arange(EXAMPLES))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def train(rank: int, world_size: int, shares: list[int] | None, state_dir: str, resume: bool,
          mixed_precision: str = "no", cpu: bool = True, shard: bool = False) -> dict:
    """With `shard`, SGD with momentum through Accelerator(shard_optimizer=True), clipped to CLIP."""
    import hsync
    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, shard_optimizer=shard)
    model = net()
    dtypes = set()  # of every linear layer's output: float32, or bfloat16 under autocast
    for layer in model:
        layer.register_forward_hook(lambda module, inputs, output: dtypes.add(str(output.dtype)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM if shard else 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert type(model) is hsync.WeightedDDP, type(model)
    assert (type(optimizer.optimizer) is hsync.ShardedOptimizer) == shard, type(optimizer.optimizer)
    balancer = hsync.Balancer(model, EXAMPLES, hsync.BalanceConfig(
        global_batch_size=GLOBAL_BATCH, rank_batch_sizes=shares, micro_batch_limit=MICRO_LIMIT, replan_every=2))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data(), batch_sampler=balancer))
    assert len(loader.dataset) == EXAMPLES and loader.total_batch_size == GLOBAL_BATCH  # as Accelerate's loaders
    if resume:
        accelerator.load_state(state_dir)
        # Accelerate's recipe for a resume skips the batches already trained: here the Balancer's state did.
        with pytest.raises(ValueError, match="a balanced loader resumes where load_state.. left its Balancer"):
            accelerator.skip_first_batches(loader, balancer.global_step)
        assert accelerator.skip_first_batches(loader, 0) is loader
    steps: list[list[int]] = [[]]
    losses, skipped = [], []
    for epoch in range(balancer.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y, index in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                steps[-1] += index.tolist()
                if shard and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                skipped.append(optimizer.step_was_skipped)  # by float16's GradScaler
                steps.append([])
                losses.append(accelerator.step_loss)
                if not resume and balancer.global_step == 4:
                    accelerator.save_state(state_dir)
    # Evaluation as Accelerate does it: the loader sharded, the predictions gathered, none twice.
    evaluation = accelerator.prepare(torch.utils.data.DataLoader(data(), batch_size=7))
    with torch.no_grad():
        gathered = [accelerator.gather_for_metrics(index) for _, _, index in evaluation]
    return {"params": {n: p.detach().cpu().clone() for n, p in accelerator.unwrap_model(model).named_parameters()},
            "steps": steps[:-1], "losses": losses, "scheduler_steps": scheduler.scheduler.last_epoch,
            "evaluated": sorted(torch.cat(gathered).tolist()), "dtypes": sorted(dtypes),
            "skipped": skipped}


def one_process(global_batches: list[list[int]], clip: float | None = None,
                weights: Callable[[torch.Tensor], torch.Tensor] | None = None, momentum: float = 0.0,
                first_layer_from_step: int = 0, first_layer_lr: float = LR,
                schedule: Callable[[int], float] | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """SGD over these global batches in one process, each in one forward; with `clip`, gradients clipped to that
    norm; with `weights` (of the examples' indices), a weighted mean of the examples' squared errors. The first
    layer trains from step `first_layer_from_step` on, at `first_layer_lr`; with `schedule`, the learning rates
    follow a LambdaLR of it, stepped after each step."""
    model, (x, y, index) = net(), data().tensors
    first = list(model[0].parameters())
    optimizer = torch.optim.SGD([{"params": first, "lr": first_layer_lr}, {"params": list(model[1:].parameters())}],
                                lr=LR, momentum=momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule is not None else None
    losses = []
    for step, indices in enumerate(global_batches):
        for p in first:
            p.requires_grad_(step >= first_layer_from_step)
        if weights is None:
            loss = nn.functional.mse_loss(model(x[indices]), y[indices])
        else:
            w = weights(index[indices])
            loss = (w * ((model(x[indices]) - y[indices]) ** 2).squeeze(1)).sum() / w.sum()
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return dict(model.named_parameters()), losses


def global_batches(ranks: list[dict]) -> list[list[int]]:
    return [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]


@pytest.mark.parametrize("shares", [[24, 8]], ids=["24+8"])  # measured shares: the resume test below
def test_accelerates_loop_steps_equal_one_process_over_the_same_global_batches(shares, tmp_path):
    ranks = run_ranks(train, 2, shares, str(tmp_path / "state"), False, env=ENV, timeout=180)
    batches = global_batches(ranks)
    steps = EPOCHS * EXAMPLES // GLOBAL_BATCH
    assert len(batches) == steps and sorted(i for b in batches[:3] for i in b) == list(range(EXAMPLES))
    if shares is not None:  # rank 0 ran its 24 in three micro-batches of 8
        assert [len(s) for s in ranks[0]["steps"]] == [24] * steps
    expected, losses = one_process(batches)
    for result in ranks:
        # Once a global batch, as in one process: the global batch does not grow with the ranks here.
        assert result["scheduler_steps"] == steps
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
        assert result["evaluated"] == list(range(EXAMPLES)), "gather_for_metrics: every example once"


def test_load_state_resumes_where_save_state_stood(tmp_path):
    straight = run_ranks(train, 2, None, str(tmp_path), False, env=ENV, timeout=180)
    expected, _ = one_process(global_batches(straight))  # measured shares, the same updates
    for result in straight:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
    resumed = run_ranks(train, 2, None, str(tmp_path), True, env=ENV, timeout=180)
    assert global_batches(resumed) == global_batches(straight)[4:]
    for before, after in zip(straight, resumed, strict=True):
        for name, value in before["params"].items():
            torch.testing.assert_close(after["params"][name], value, rtol=1e-5, atol=1e-6)


def test_a_sharded_optimizer_steps_clips_saves_and_resumes_as_one_process(tmp_path):
    """shard_optimizer=True: momentum's state split across the ranks, clipping over both shards, save_state's
    whole state read back by load_state, against SGD with momentum and clipping in one process."""
    straight = run_ranks(train, 2, None, str(tmp_path), False, "no", True, True, env=ENV, timeout=180)
    expected, losses = one_process(global_batches(straight), clip=CLIP, momentum=MOMENTUM)
    resumed = run_ranks(train, 2, None, str(tmp_path), True, "no", True, True, env=ENV, timeout=180)
    for result in straight + resumed:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
    assert straight[0]["losses"] == pytest.approx(losses, rel=1e-5)


def test_one_plain_process_trains_as_with_accelerates_own_prepare(tmp_path):
    # Accelerate starts no process group for one process; the wrapper gets a group of one.
    alone = run_ranks(integrations.alone, 1, train, None, str(tmp_path), False, timeout=180)[0]
    assert [len(step) for step in alone["steps"]] == [GLOBAL_BATCH] * (EPOCHS * EXAMPLES // GLOBAL_BATCH)
    expected, losses = one_process(alone["steps"])
    assert alone["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in expected.items():
        torch.testing.assert_close(alone["params"][name], value, rtol=1e-5, atol=1e-6)


def test_bf16_runs_the_forward_under_autocast_and_stays_near_float32(tmp_path):
    # Against one float32 process over the same global batches, which a float32 run equals (above).
    mixed = run_ranks(train, 2, [24, 8], str(tmp_path), False, "bf16", env=ENV, timeout=180)
    expected, losses = one_process(global_batches(mixed))
    for result in mixed:
        assert result["dtypes"] == ["torch.bfloat16"]
        assert result["losses"] == pytest.approx(losses, rel=2e-3)
        assert_near_float32(result["params"], expected, dict(net().named_parameters()))
    torch.testing.assert_close(mixed[0]["params"], mixed[1]["params"], rtol=0, atol=0)


def refused(rank: int, world_size: int) -> str:
    from hsync.integrations.accelerate import Accelerator

    try:
        Accelerator(cpu=True, gradient_accumulation_steps=2)
    except ValueError as error:
        return str(error)
    return "no error"


def test_gradient_accumulation_by_count_is_refused_on_every_rank():
    for message in run_ranks(refused, 2, env=ENV):
        assert "gradient_accumulation_steps must stay 1" in message, message


def test_an_accelerate_release_outside_the_tested_range_is_refused(monkeypatch):
    import hsync.integrations.accelerate as integration

    monkeypatch.setattr(integration.accelerate, "__version__", "0.34.2")
    with pytest.raises(RuntimeError, match="supports accelerate >= 1.1, < 2; found 0.34.2"):
        integration.Accelerator(cpu=True)


def as_accelerate_sees_it(rank: int, world_size: int, cpu: bool | None) -> tuple | str:
    from hsync.integrations.accelerate import Accelerator

    try:
        accelerator = Accelerator() if cpu is None else Accelerator(cpu=cpu)
    except ValueError as error:
        return str(error)
    return accelerator.num_processes, accelerator.process_index, accelerator.is_main_process


def test_launched_on_cpus_every_rank_knows_its_place_and_accelerate_kept_to_one_process_is_refused():
    # Accelerate alone, under torchrun on a machine without GPUs, runs each rank as a job of its own unless told
    # cpu=True: each took itself for the main process (saving, say, on every rank) while hsync's ranks trained
    # together. Told nothing, the ranks are Accelerate's too; told cpu=False, it is refused on every rank.
    assert run_ranks(as_accelerate_sees_it, 2, None, env=ENV) == [(2, 0, True), (2, 1, False)]
    for message in run_ranks(as_accelerate_sees_it, 2, False, env=ENV):
        assert message == ("hsync.integrations.accelerate: launched as 2 processes, but Accelerate runs as 1 "
                           "(DistributedType.NO), so each rank would take itself for the main process; on "
                           "CPUs pass Accelerator(cpu=True)"), message


def prepare_a_wrapped_model(rank: int, world_size: int, wrapper: str) -> str:
    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = (torch.nn.parallel.DistributedDataParallel if wrapper == "ddp" else torch.nn.DataParallel)(net())
    try:
        accelerator.prepare(model)
    except TypeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(("wrapper", "named"), [("ddp", "a DistributedDataParallel"),
                                                ("data-parallel", "a torch DataParallel")])
def test_a_model_already_wrapped_is_refused_in_one_line_on_every_rank(wrapper, named):
    for message in run_ranks(prepare_a_wrapped_model, 2, wrapper, env=ENV):
        assert message == (f"hsync.integrations.accelerate.Accelerator.prepare: the model is already wrapped in "
                           f"{named}; pass the module inside it (its .module): hsync wraps it itself"), message


# Hyperparameters off their defaults, so that one lost on the way to the shards changes the steps. AdamW records
# decoupled_weight_decay in its defaults, which its constructor does not take.
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=3e-2, betas=(0.8, 0.9), weight_decay=0.05, amsgrad=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=5e-2, lr_decay=0.01, initial_accumulator_value=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9, momentum=0.5, centered=True)),
}


def steps_of(model: nn.Module, optimizer: torch.optim.Optimizer, backward: Callable) -> None:
    x, y, _ = data()[:16]
    for _ in range(3):
        backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def sharded_steps(rank: int, world_size: int, name: str) -> dict[str, torch.Tensor]:
    """Every rank the same 16 examples a step, so the weighted mean is one process's gradient."""
    import hsync
    from hsync.integrations.accelerate import Accelerator

    optimizer_class, hyperparameters = OPTIMIZERS[name]
    accelerator = Accelerator(cpu=True, shard_optimizer=True)
    model = net()
    model, optimizer = accelerator.prepare(model, optimizer_class(model.parameters(), **hyperparameters))
    assert type(optimizer.optimizer) is hsync.ShardedOptimizer, type(optimizer.optimizer)
    steps_of(model, optimizer, lambda loss: model.backward(loss, weight=16))
    return {key: value.detach().clone() for key, value in model.module.state_dict().items()}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_sharded_optimizer_keeps_the_prepared_optimizers_hyperparameters(name):
    optimizer_class, hyperparameters = OPTIMIZERS[name]
    model = net()
    steps_of(model, optimizer_class(model.parameters(), **hyperparameters), lambda loss: loss.backward())
    for params in run_ranks(sharded_steps, 2, name, env=ENV, timeout=120):
        for key, value in model.state_dict().items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6)


def scheduled_lr(rank: int, world_size: int) -> list[float]:
    """One epoch of balanced global steps under a decaying LambdaLR, prepared with the optimizer and loader."""
    import hsync
    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    balancer = hsync.Balancer(model, EXAMPLES, hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH))
    optimizer, scheduler, loader = accelerator.prepare(
        optimizer, scheduler, torch.utils.data.DataLoader(data(), batch_sampler=balancer))
    for x, y, _ in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return scheduler.get_last_lr()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_prepared_scheduler_steps_once_per_global_step_on_any_number_of_ranks(world_size):
    steps = EXAMPLES // GLOBAL_BATCH  # what len(loader) says on every rank
    for lr in run_ranks(scheduled_lr, world_size, env={**ENV, "WORLD_SIZE": str(world_size)}, timeout=120):
        assert lr == [pytest.approx(LR / (1 + steps))]


def halving(step: int) -> float:
    return 0.5 ** step


def loop_written_for_one_batch_a_step(rank: int, world_size: int, shard: bool) -> dict:
    """A loop written for Accelerate at gradient_accumulation_steps=1, where each batch is a step: zero_grad() at
    the top of accumulate()'s body, clipping after every backward unguarded, a scheduler built on the optimizer
    before prepare(). Rank 0 runs its 24 examples of a step in three micro-batches, rank 1 its 8 in one."""
    import hsync
    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True, shard_optimizer=shard)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, halving)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    balancer = hsync.Balancer(model, EXAMPLES, hsync.BalanceConfig(
        global_batch_size=GLOBAL_BATCH, rank_batch_sizes=[24, 8], micro_batch_limit=MICRO_LIMIT))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data(), batch_sampler=balancer))
    assert loader.batch_size is None and loader.num_workers == 0  # the DataLoader's, as with a batch_sampler
    steps: list[list[int]] = [[]]
    norms, gathered = [], []
    for x, y, index in loader:
        with accelerator.accumulate(model):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            steps[-1] += index.tolist()
            norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP))
            optimizer.step()
            scheduler.step()
        if accelerator.sync_gradients:  # each rank's examples of the step (24 and 8), and a loss of each
            gathered.append((accelerator.gather(torch.tensor(steps[-1])).tolist(),
                             accelerator.gather(loss.detach()).shape))
            steps.append([])
    return {"params": {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()},
            "steps": steps[:-1], "clipped": [norm is not None for norm in norms], "gathered": gathered}


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
def test_a_loop_written_for_one_batch_a_step_trains_as_one_process(shard):
    # Zeroed at the top, the step's earlier micro-batches were lost (0.095 off one process after 3 steps); clipped
    # after each backward, the partial sums were (and with shard_optimizer the clip's collective met the peer's step,
    # and gloo ended the process); the scheduler stepped an optimizer the ShardedOptimizer had copied; gathered, a
    # step's examples of each rank ended the process.
    ranks = run_ranks(loop_written_for_one_batch_a_step, 2, shard, env=ENV, timeout=180)
    expected, _ = one_process(global_batches(ranks), clip=CLIP, momentum=MOMENTUM, schedule=halving)
    assert ranks[0]["clipped"] == [False, False, True] * (EXAMPLES // GLOBAL_BATCH)  # the step's last only
    assert ranks[1]["clipped"] == [True] * (EXAMPLES // GLOBAL_BATCH)
    # gather() of tensors whose sizes differ across ranks (gloo ended the process), and of 0-dim ones.
    for result in ranks:
        assert result["gathered"] == [(ours + theirs, torch.Size([2]))
                                      for ours, theirs in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    for result in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)


def two_trained_models(rank: int, world_size: int) -> str:
    import hsync
    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    teacher = net().requires_grad_(False)
    encoder, head, teacher = accelerator.prepare(net()[:2], nn.Linear(16, 1), teacher)
    assert type(teacher) is nn.Sequential  # nothing to train: unwrapped, as Accelerate leaves it
    balancer = hsync.Balancer(encoder, EXAMPLES, hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH))
    try:
        accelerator.prepare(torch.utils.data.DataLoader(data(), batch_sampler=balancer))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_second_trained_model_beside_a_balancer_is_refused_on_every_rank():
    # Its gradients were reduced with DDP's equal weights beside the Balancer's weighted step (the head 0.03 off one
    # process), or, with more micro-batches on one rank, the ranks waited in different collectives to the deadline.
    for message in run_ranks(two_trained_models, 2, env=ENV, timeout=120):
        assert message == ("hsync.integrations.accelerate: a Balancer weighs the gradients of one prepared model, "
                           "and 2 with parameters to train were prepared; put the trained parts in one nn.Module "
                           "(say nn.ModuleDict(encoder=encoder, head=head)) and prepare that"), message


def ddp_kwargs_and_a_retry(rank: int, world_size: int) -> dict:
    """DistributedDataParallelKwargs reach the wrapper (and its hook), and free_memory() lets a retry (as
    find_executable_batch_size's) prepare a new model, optimizer and Balancer."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    import hsync
    from hsync.integrations.accelerate import Accelerator

    kwargs = DistributedDataParallelKwargs(broadcast_buffers=False, bucket_cap_mb=1,
                                           comm_hook=DDPCommunicationHookType.BF16)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    seen = {}
    for attempt in range(2):
        model, optimizer = accelerator.prepare(net(), torch.optim.SGD(net().parameters(), lr=LR))
        balancer = hsync.Balancer(model, EXAMPLES, hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH))
        loader = accelerator.prepare(torch.utils.data.DataLoader(data(), batch_sampler=balancer))
        seen[attempt] = (model.broadcast_buffers, model.bucket_bytes_cap, str(model.comm_dtype), len(loader))
        accelerator.free_memory()
    return seen


def test_ddp_kwargs_are_honoured_and_free_memory_lets_a_retry_prepare_anew():
    for seen in run_ranks(ddp_kwargs_and_a_retry, 2, env=ENV, timeout=120):
        assert seen[0] == seen[1] == (False, 2 ** 20, "torch.bfloat16", EXAMPLES // GLOBAL_BATCH), seen
