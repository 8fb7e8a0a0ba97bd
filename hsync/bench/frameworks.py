"""Mixed-speed rows through the frameworks people train with: hsync's transformers.Trainer against
transformers' own, hsync's Accelerator against Accelerate's, Lightning's strategy "hsync" against its
"ddp", on the same job with rank 1 slowed 2x (SimulatedSlowdown), costing more per example (SimulatedCost), or
with equal ranks (where the plan must stay at the equal split), cores pinned a rank each where the machine has
them (balancing.core_per_rank).

Each variant runs its framework's own loop (Trainer.train(), an `accelerator.accumulate` loop,
Lightning's Trainer.fit()) in rounds of `steps` steps that alternate; a step's time is the interval
between two optimizer steps, taken on the slowest rank. The hsync variant first runs until its Balancer
has a plan from measurements."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import hsync
from hsync.bench.balancing import (
    AffineCosts,
    SimulatedClock,
    Slowed,
    SplitLog,
    attainable,
    core_per_rank,
    fitted_costs,
    pace,
)
from hsync.bench.result import NAN, Result, slowest_rank_quantiles

VOCAB = 1000
# Each variant's run of n timed steps (their seconds), and the hsync variant's Balancer once it exists.
Variants = tuple[dict[str, Callable[[int], list[float]]], Callable[[], hsync.Balancer]]


def framework_mixed(name: str, framework: str, device: torch.device, simulated: Slowed | AffineCosts, rounds: int,
                    steps: int, quick: bool) -> Result:
    """`framework` ("trainer", "accelerate" or "lightning") with hsync against without, ranks of `simulated`
    speeds; with affine costs, `of_attainable` as balancing.attainable() defines it, each rank's step alone
    being the model's forward, backward and AdamW step (the framework's per-batch work is in the overhead
    measured on equal shares)."""
    with core_per_rank(device) as pinned:
        result = _framework_mixed(name, framework, device, simulated, rounds, steps, quick)
    result.extra["core_per_rank"] = float(pinned)
    return result


def _framework_mixed(name: str, framework: str, device: torch.device, simulated: Slowed | AffineCosts, rounds: int,
                     steps: int, quick: bool) -> Result:
    import transformers

    transformers.logging.set_verbosity_error()
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, layers, per_rank, seq = (32, 1, 4, 32) if quick else (128, 2, 32, 64)
    if isinstance(simulated, AffineCosts):  # a tiny model: the simulated costs, of known best split, are most of a step
        hidden, layers, seq = 32, 1, 32
    global_batch = per_rank * world
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (16 * global_batch, seq), generator=g)
    examples = [{"input_ids": row, "labels": int(row[0] % 2)} for row in ids]
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=max(1, hidden // 32), intermediate_size=4 * hidden,
                                     max_position_embeddings=seq)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(config).to(device)

    run = {"trainer": _trainer_variants, "accelerate": _accelerate_variants, "lightning": _lightning_variants}
    split_log = SplitLog()
    variants, balancer_now = run[framework](model, examples, per_rank, global_batch,
                                            lambda: simulated.clock(rank, device), device, pace(quick), split_log)
    while balancer_now().decisions < 2:  # warm-up, probes and the equal split measured: the plan in force after
        variants["hsync"](steps)
    split_log.splits.clear()
    times: dict[str, list[float]] = {"hsync": [], "ddp": []}
    for _ in range(rounds):
        for variant in ("hsync", "ddp"):
            times[variant] += variants[variant](steps)
    med, p90 = slowest_rank_quantiles(times)
    hs, dd = med["hsync"], med["ddp"]
    extra = {"hsync_samples_per_s": global_batch / hs, "ddp_samples_per_s": global_batch / dd,
             "speedup_vs_ddp": dd / hs}
    if isinstance(simulated, Slowed):
        extra["ideal_speedup"] = simulated.ideal_speedup()
    else:
        bare = model()
        optimizer = torch.optim.AdamW(bare.parameters(), lr=1e-4)
        cost = simulated.clock(rank, device)

        def step_alone(n: int) -> None:
            bare(**{k: v.to(device) for k, v in _collate(examples[:n]).items()}).loss.backward()
            cost.pause_ahead(n)
            optimizer.step()
            optimizer.zero_grad()

        extra |= attainable(step_alone, global_batch, dd, hs, steps, device)
    extra |= {f"plan_rank{r}": n for r, n in enumerate(balancer_now().last_plan)}
    extra["plan_changes"] = split_log.changes()
    extra |= fitted_costs(balancer_now())
    return Result(name, hs, dd, NAN, p90["hsync"], p90["ddp"], NAN, global_batch, extra=extra)


def _collate(features: list[dict]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack([f["input_ids"] for f in features]),
            "labels": torch.tensor([f["labels"] for f in features])}


def _trainer_variants(model: Callable[[], torch.nn.Module], examples: list[dict], per_rank: int, global_batch: int,
                      make_clock: Callable[[], SimulatedClock], device: torch.device, pacing: dict[str, int],
                      split_log: SplitLog) -> Variants:
    import transformers

    from hsync.integrations.transformers import BalancingArguments, Trainer

    def arguments(batch: int) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            output_dir="/tmp/hsync-bench-trainer", per_device_train_batch_size=batch, learning_rate=1e-4,
            max_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, logging_strategy="no",
            use_cpu=device.type == "cpu", dataloader_pin_memory=False)

    class StepTimer(transformers.TrainerCallback):
        """Times the intervals between optimizer steps; slows the plain Trainer's rank with a pause before each
        step's work, as for torch DDP (SimulatedSlowdown.pause_ahead). A balanced Trainer's slowdown is its
        Balancer's clock, which pauses when each step's own work is done."""

        def __init__(self, slowdown: SimulatedClock, balanced: bool) -> None:
            self.slowdown, self.balanced, self.intervals, self.last = slowdown, balanced, [], 0.0

        def reset(self) -> None:
            self.intervals, self.last = [], time.perf_counter()
            self.slowdown.restart()  # the other variant's work is no part of this one's first step

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.balanced:  # a Balancer pauses with its clock itself
                self.slowdown.pause_ahead(per_rank)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.balanced:
                split_log.record(ours.balancer)
            else:
                self.slowdown.step_done()
            now = time.perf_counter()
            self.intervals.append(now - self.last)
            self.last = now

    our_slowdown = make_clock()

    class SlowedTrainer(Trainer):
        def _new_balancer(self, model: Any, examples: Any, config: hsync.BalanceConfig) -> hsync.Balancer:
            return hsync.Balancer(model, examples, config, clock=our_slowdown)

    plain = transformers.Trainer(model=model(), args=arguments(per_rank), train_dataset=examples,
                                 data_collator=_collate,
                                 callbacks=[StepTimer(make_clock(), balanced=False)])
    # A share of up to the whole global batch in one micro-batch, as plain Trainer's per-rank batch is one.
    ours = SlowedTrainer(model=model(), args=arguments(global_batch), train_dataset=examples, data_collator=_collate,
                         callbacks=[StepTimer(our_slowdown, balanced=True)],
                         balancing=BalancingArguments(global_batch_size=global_batch, **pacing,
                                                      by_tokens=False))

    def run(trainer: transformers.Trainer) -> Callable[[int], list[float]]:
        def steps(count: int) -> list[float]:
            trainer.args.max_steps = count + 1  # the first interval carries the switch: not timed
            balancer = getattr(trainer, "balancer", None)
            if balancer is not None:
                # Each train() starts at epoch 0 (Trainer's set_epoch(0)); a Balancer still in epoch 0 would go on
                # where the last call left it, and its epoch would end before max_steps.
                balancer.set_epoch(balancer.epoch + 1)
            clock_of(trainer).reset()
            trainer.train()
            return clock_of(trainer).intervals[1:]
        return steps

    def clock_of(trainer: transformers.Trainer) -> StepTimer:
        return next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepTimer))

    variants = {"ddp": run(plain), "hsync": run(ours)}
    variants["hsync"](2)  # builds the Balancer
    return variants, lambda: ours.balancer


def _accelerate_variants(model: Callable[[], torch.nn.Module], examples: list[dict], per_rank: int,
                         global_batch: int, make_clock: Callable[[], SimulatedClock], device: torch.device,
                         pacing: dict[str, int], split_log: SplitLog) -> Variants:
    import accelerate

    from hsync.integrations.accelerate import Accelerator

    theirs = accelerate.Accelerator(cpu=device.type == "cpu")
    plain_model = theirs.prepare(model())
    plain_optimizer = theirs.prepare(torch.optim.AdamW(plain_model.parameters(), lr=1e-4))
    plain_loader = theirs.prepare(torch.utils.data.DataLoader(examples, batch_size=per_rank, shuffle=True,
                                                              collate_fn=_collate))
    ours = Accelerator(cpu=device.type == "cpu")
    net = ours.prepare(model())
    optimizer = ours.prepare(torch.optim.AdamW(net.parameters(), lr=1e-4))
    our_slowdown = make_clock()
    balancer = hsync.Balancer(net, len(examples), hsync.BalanceConfig(global_batch_size=global_batch, **pacing),
                              clock=our_slowdown)
    loader = ours.prepare(torch.utils.data.DataLoader(examples, batch_sampler=balancer, collate_fn=_collate))
    plain_slowdown = make_clock()

    def forever(batches: Any) -> Any:
        while True:
            yield from batches

    plain_batches, our_batches = forever(plain_loader), forever(loader)

    def plain_step() -> None:
        with theirs.accumulate(plain_model):
            loss = plain_model(**next(plain_batches)).loss
            plain_slowdown.pause_ahead(per_rank)  # before the backward, which ends with the reduction
            theirs.backward(loss)
            plain_optimizer.step()
            plain_optimizer.zero_grad()
        plain_slowdown.step_done()

    def our_step() -> None:
        while True:
            with ours.accumulate(net):
                ours.backward(net(**next(our_batches)).loss)
                optimizer.step()
                optimizer.zero_grad()
            if ours.sync_gradients:
                split_log.record(balancer)
                return

    def timed(step: Callable[[], None], restart: Callable[[], None]) -> Callable[[int], list[float]]:
        def steps(count: int) -> list[float]:
            restart()  # the other variant's work is no part of this one's first step
            step()  # carries the switch: not timed
            times, started = [], time.perf_counter()
            for _ in range(count):
                step()
                now = time.perf_counter()
                times.append(now - started)
                started = now
            return times
        return steps

    return ({"ddp": timed(plain_step, plain_slowdown.restart), "hsync": timed(our_step, our_slowdown.restart)},
            lambda: balancer)


def _lightning_variants(model: Callable[[], torch.nn.Module], examples: list[dict], per_rank: int,
                        global_batch: int, make_clock: Callable[[], SimulatedClock], device: torch.device,
                        pacing: dict[str, int], split_log: SplitLog) -> Variants:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from hsync.integrations.lightning import HsyncStrategy

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(examples, batch_size=per_rank, shuffle=True, collate_fn=_collate)

    class StepTimer(L.Callback):
        """Times the intervals between optimizer steps; slows the plain strategy's rank with a pause before each
        step's work, as for torch DDP (SimulatedSlowdown.pause_ahead). HsyncStrategy's slowdown is its Balancer's
        clock, which pauses when each step's own work is done."""

        def __init__(self, slowdown: SimulatedClock, balanced: bool) -> None:
            self.slowdown, self.balanced, self.intervals, self.last = slowdown, balanced, [], 0.0

        def reset(self) -> None:
            self.intervals, self.last = [], time.perf_counter()
            self.slowdown.restart()  # the other variant's work is no part of this one's first step

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if not self.balanced:
                self.slowdown.pause_ahead(per_rank)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.balanced:
                split_log.record(trainer.strategy.balancer)
            else:
                self.slowdown.step_done()
            now = time.perf_counter()
            self.intervals.append(now - self.last)
            self.last = now

    def variant(strategy: Any, clock: StepTimer) -> Callable[[int], list[float]]:
        trainer = L.Trainer(strategy=strategy, accelerator="gpu" if device.type == "cuda" else "cpu",
                            devices=dist.get_world_size(), max_epochs=-1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
        module = Classifier()

        def steps(count: int) -> list[float]:
            trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + count + 1  # the first interval: the switch
            clock.reset()
            trainer.fit(module)  # each call goes on where the last stopped (a Balancer's plan included)
            return clock.intervals[1:]
        return steps

    our_slowdown = make_clock()

    class SlowedStrategy(HsyncStrategy):
        def _new_balancer(self, model: Any, examples: Any, config: hsync.BalanceConfig) -> hsync.Balancer:
            return hsync.Balancer(model, examples, config, clock=our_slowdown)

    # A rank's share in one micro-batch, as plain DDP's per-rank batch is one.
    ours = SlowedStrategy(balance=hsync.BalanceConfig(global_batch_size=global_batch, **pacing))
    variants = {"ddp": variant(DDPStrategy(), StepTimer(make_clock(), balanced=False)),
                "hsync": variant(ours, StepTimer(our_slowdown, balanced=True))}
    variants["hsync"](2)  # builds the Balancer
    return variants, lambda: ours.balancer
