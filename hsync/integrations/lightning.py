"""Lightning with hsync: `Trainer(strategy="hsync")` runs a LightningModule unchanged, each rank's share of
every global batch planned from its measured speed, and the gradient the exact weighted mean over ranks
(pip install hsync[lightning]).

    import hsync.integrations.lightning                    # registers the strategy "hsync"

    trainer = L.Trainer(strategy="hsync", accelerator="gpu", devices=4)   # or HsyncStrategy(balance=...)
    trainer.fit(module, datamodule)

Note [Lightning]
Lightning's DDP strategy wraps the module in torch's DDP, gives every rank the same batch size through a
DistributedSampler, and counts accumulate_grad_batches batches to a step. HsyncStrategy, a DDPStrategy,
changes the seams where that happens:
- _setup_model wraps the module in hsync.WeightedDDP (the same DDP options);
- process_dataloader replaces the train dataloader by one whose item is a whole optimizer step: this
  rank's micro-batches of it, as an hsync.Balancer splits the step (the loader's batch_size x
  accumulate_grad_batches x ranks, or BalanceConfig's global_batch_size; micro-batches of at most
  batch_size when accumulating), collated by the loader's collate_fn in its workers. Lightning then
  counts one item as one step (its accumulate_grad_batches is set to 1), so max_steps, epochs, schedulers
  and the progress bar count optimizer steps;
- training_step runs the module's training_step on each micro-batch and backward makes each backward a
  weighted one through the Balancer (the micro-batch's examples, or the "weight" the module's
  training_step returns beside its "loss", e.g. its tokens for a mean over tokens). The precision plugin
  scales each loss as it would (16-mixed's GradScaler), and the optimizer steps once, after the last.
  Lightning zeroes gradients after the training_step whose loss it backpropagates (the last micro-batch's),
  so the gradients of the others are set aside across that zeroing;
- self.log(..., sync_dist=True) in a training_step syncs once a step, at the last micro-batch: ranks run
  different numbers of micro-batches, and a collective per call would pair one rank's first micro-batch
  with another's last (or wait forever). Lightning's mean over ranks of an integer (a metric's count of
  examples) truncates, harmless where every rank counts alike; here it is taken in floating point. Each
  micro-batch's logs weigh its own examples in the epoch's mean (Lightning would infer every one's from the
  step's item, its first micro-batch), and a step's value (on_step) weighs each rank's by the examples of its
  last micro-batch: a rank's whole share where it runs in one, so the step's mean over every example; under
  accumulation the ranks' last micro-batches, as DDP logs the last;
- those syncs, and the SIGTERM flag Lightning broadcasts before every batch, are waits for peers
  (WeightedDDP.waiting_for_peers): counted as work, a fast rank's wait there would make it look as slow
  as the slowest, and the Balancer would keep an equal split;
- a ddp_comm_hook (PowerSGD, the user's own) is registered on the WeightedDDP, on the CPU too;
- parameters a callback unfreezes at an epoch's start (BackboneFinetuning, after the model was wrapped) are
  reduced from that epoch on: setup() appends a callback of hsync's to trainer.callbacks, after the user's, that
  calls WeightedDDP.refresh_trainable_parameters() there (DDPStrategy's DDP would leave their gradients each
  rank's own). An unfreezing at another point is refused at the next step, naming the parameter;
- the train loader is stateful (state_dict / load_state_dict: the Balancer's), which Lightning saves in
  every checkpoint and restores with ckpt_path= inside an epoch; the strategy restores it from a checkpoint
  written at an epoch's end too, where Lightning does not. So a resumed run goes on with the same global
  batches;
- evaluation loaders are Lightning's, as under DDP: its DistributedSampler repeats a few examples so that
  every rank runs as many batches, and a validation_step's collectives per batch (self.log(on_step=True,
  sync_dist=True), all_gather) pair up (a sampler that repeats none gave the ranks different numbers of
  batches: a wrong value on one rank, an ended process on another). The module evaluates without its
  wrapper, after its buffers are made rank 0's;
- the Balancer orders the examples as Lightning's DistributedSampler would (seed_everything's seed, shuffled
  or not) and Lightning sets its epoch through the step loader's batch sampler, so each epoch's global
  batches are DDP's; a reloaded train loader over other data gets a Balancer of its own;
- a step that carried no weight on any rank (every training_step returned None) leaves no gradient, so the
  optimizer moves nothing;
- the module's on_before_batch_transfer gets each micro-batch (the fit loop would hand it the whole step);
- an hsync.ShardedOptimizer returned by configure_optimizers (over self.trainer.model, the WeightedDDP by
  then) is checkpointed as Lightning checkpoints torch's ZeroRedundancyOptimizer (consolidate_state_dict,
  the whole state in the file, loaded on every rank), and gradient_clip_val clips through its
  clip_grad_norm_: Lightning's precision plugin would take the norm of this rank's gradients alone, which
  with owners are its own shard. Lightning has no public seam for that, so setup() sets the plugin's
  clip_grad_by_norm on the instance. The optimizer is the module's to build, not a strategy option:
  Lightning builds the schedulers in the same call, bound to the optimizer built there.

Of hsync, the strategy uses the public API only (WeightedDDP, its balance(), waiting_for_peers(),
sync_buffers(), refresh_trainable_parameters() and has_comm_hook, the Balancer, ShardedOptimizer): the seam
every integration uses (docs/internals.md). Of Lightning it reaches past the public API in four places,
which its releases may change: DDPStrategy's hooks named above (_setup_model, _register_ddp_hooks and the
_ddp_comm_* arguments it keeps, handed to lightning's _register_ddp_comm_hook as DDPStrategy hands them), the
precision plugin's clip_grad_by_norm, the module's _on_before_batch_transfer (the fit loop's call of the
hook, replaced on the instance until teardown), and the fit loop's _broadcast_sigterm_tensor, which it
replaces by the same broadcast bracketed as a wait for peers: Lightning offers no way to bracket its own
collectives. So the
releases it accepts are pinned (SUPPORTED in _world.py: >= 2.4, < 3; tests/integrations/test_lightning.py runs
on 2.6), and a release where the loop has no _broadcast_sigterm_tensor leaves the broadcast unbracketed
(counted as work) rather than failing.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Any

import lightning
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

import hsync
from hsync.collectives import Channels
from hsync.integrations._loaders import MicroBatches, StepLoader
from hsync.integrations._world import check_framework_version, put_the_frameworks_collectives_under_the_deadline
from hsync.stats import StepStats

_DDP_ONLY = ("model_averaging_period",)


class _RefreshTrainableParameters(Callback):
    """Takes what the user's callbacks unfroze at an epoch's start (BackboneFinetuning's backbone) into the
    buckets, on every rank alike, before the epoch's first step."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.model.refresh_trainable_parameters()


class HsyncStrategy(DDPStrategy):
    """Lightning's DDP strategy with hsync in DDP's place (Note [Lightning]). `balance`: how each step is split
    (None: the train loader's batch_size x accumulate_grad_batches x ranks, planned from measured speeds);
    other keyword arguments are DDPStrategy's, its DDP options (find_unused_parameters, ...) included."""

    strategy_name = "hsync"

    def __init__(self, balance: hsync.BalanceConfig | None = None, **kwargs: Any) -> None:
        check_framework_version(lightning)
        for option in _DDP_ONLY:
            if kwargs.get(option) is not None:
                raise ValueError(f"HsyncStrategy: {option} averages the ranks' models every few steps, which "
                                 "weighted steps do not need and hsync does not run (use strategy='ddp' for it)")
        if balance is not None and not isinstance(balance, hsync.BalanceConfig):
            raise TypeError(f"HsyncStrategy(balance=...) takes an hsync.BalanceConfig, got {type(balance).__name__}")
        super().__init__(**kwargs)
        self.balance = balance
        self.balancer: hsync.Balancer | None = None
        self._weighted: hsync.WeightedDDP | None = None
        self.step_stats: StepStats | None = None
        """The last complete step's StepStats (loss and examples over every rank, the non-finite flag)."""
        self._micro_batches_per_step: int | None = None  # accumulate_grad_batches, before setup() makes it 1
        self._weight: float | torch.Tensor | None = None
        self._leading_micro_batch = False  # a micro-batch before the step's last: its logs are not synced
        self._last_micro_batch_examples: int | None = None  # while the step's last runs: what its logs weigh
        self._set_aside: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # see training_step
        self._resumed_loader_state: dict | None = None  # see load_checkpoint
        self._balanced_data: tuple[int, hsync.BalanceConfig] | None = None  # the Balancer's examples and config

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="hsync: weighted DDP with balanced batches")

    # -- the model -----------------------------------------------------------------------------------

    def _setup_model(self, model: torch.nn.Module) -> hsync.WeightedDDP:
        # A later fit() of the same module keeps its wrapper, and with it the Balancer and what it measured.
        if self._weighted is None or self._weighted.module is not model:
            # The strategy's timeout, where one was given, is hsync's deadline too (Lightning's default, 30 minutes,
            # is not: hsync's own holds then).
            timeout = self._timeout if self._timeout != default_pg_timeout else None
            self._weighted = hsync.WeightedDDP(model, device_ids=self.determine_ddp_device_ids(), timeout=timeout,
                                               **self._ddp_kwargs)
            put_the_frameworks_collectives_under_the_deadline(self._weighted)
        return self._weighted

    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers a ddp_comm_hook on GPUs only; hsync runs one on the CPU too, once per wrapper
        # (a later fit() keeps it).
        if self._ddp_comm_hook is not None and not self.model.has_comm_hook:
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

    def setup(self, trainer: Any) -> None:
        if any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
            raise ValueError("HsyncStrategy: a GradientAccumulationScheduler changes accumulate_grad_batches per "
                             "epoch, but the Balancer's global batch is fixed; set accumulate_grad_batches instead")
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise ValueError("HsyncStrategy needs automatic optimization: the Balancer runs each rank's micro-batches "
                             "of a step through the module's training_step and steps the optimizer once; a module "
                             "that steps it itself (automatic_optimization = False) would step once a micro-batch")
        if type(module).backward is not LightningModule.backward:
            raise ValueError(f"HsyncStrategy: {type(module).__name__} overrides backward(), which the Balancer's "
                             "weighted backward takes the place of (it would never be called); move its work to "
                             "on_before_backward / on_after_backward, which run for every micro-batch")
        self._transfer_each_micro_batch(module)
        self._bracket_the_sigterm_broadcast(trainer)
        if not any(isinstance(callback, _RefreshTrainableParameters) for callback in trainer.callbacks):
            trainer.callbacks.append(_RefreshTrainableParameters())  # after the user's: Note [Lightning]
        if self._micro_batches_per_step is None:  # a later fit() on the same Trainer finds 1 here
            self._micro_batches_per_step = trainer.accumulate_grad_batches
        # The Balancer cuts each rank's share into micro-batches; Lightning counts one item as one step.
        trainer.accumulate_grad_batches = 1
        super().setup(trainer)
        if any(isinstance(o, hsync.ShardedOptimizer) for o in self.optimizers):
            self._clip_sharded_optimizers()

    def _clip_sharded_optimizers(self) -> None:
        """gradient_clip_val over every rank's shard (Note [Lightning])."""
        if getattr(self.precision_plugin, "scaler", None) is not None:
            # A plain loop's GradScaler steps a ShardedOptimizer alike on every rank
            # (Note [A non-finite step on every rank]); 16-mixed's unscaling and clipping
            # of one has yet to be tested on a GPU.
            raise ValueError("HsyncStrategy: an hsync.ShardedOptimizer does not take 16-mixed's GradScaler yet; use "
                             "bf16-mixed, or no sharding")
        plugin = self.precision_plugin
        by_norm = plugin.clip_grad_by_norm
        if getattr(by_norm, "_over_shards", False):
            return

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
            if isinstance(optimizer, hsync.ShardedOptimizer):
                optimizer.clip_grad_norm_(clip_val)
            else:
                by_norm(optimizer, clip_val)

        clip_grad_by_norm._over_shards = True
        plugin.clip_grad_by_norm = clip_grad_by_norm

    @staticmethod
    def _transfer_each_micro_batch(module: Any) -> None:
        """The fit loop hands the module's on_before_batch_transfer the loader's item, here a whole step: each
        micro-batch goes through it instead, as its on_after_batch_transfer does (batch_to_device). Lightning calls
        the hook through the module's _on_before_batch_transfer, replaced on the instance until teardown."""
        if "_on_before_batch_transfer" in vars(module):
            return
        each = module._on_before_batch_transfer

        def per_micro_batch(batch: Any, dataloader_idx: int = 0) -> Any:
            if isinstance(batch, MicroBatches):
                return MicroBatches(each(micro, dataloader_idx) for micro in batch)
            return each(batch, dataloader_idx)

        module._on_before_batch_transfer = per_micro_batch

    def _bracket_the_sigterm_broadcast(self, trainer: Any) -> None:
        """Lightning broadcasts rank 0's SIGTERM flag before every training batch, past the strategy: bracketed as
        a wait for peers (WeightedDDP.waiting_for_peers), or the fast ranks' waits there count as their work."""
        loop = trainer.fit_loop.epoch_loop
        broadcast = getattr(loop, "_broadcast_sigterm_tensor", None)
        if broadcast is None or getattr(broadcast, "_bracketed", False):
            return

        def bracketed() -> None:
            with self._waiting_for_peers():
                broadcast()

        bracketed._bracketed = True
        loop._broadcast_sigterm_tensor = bracketed

    def _waiting_for_peers(self) -> Any:
        return self.model.waiting_for_peers() if isinstance(self.model, hsync.WeightedDDP) else nullcontext()

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # DDPStrategy's prepares torch DDP's reducer; WeightedDDP's backward needs nothing before

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # DDPStrategy's flushes torch DDP's reducer after a static graph's first manual step

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            vars(module).pop("_on_before_batch_transfer", None)  # see _transfer_each_micro_batch
        if isinstance(self.model, hsync.WeightedDDP):  # DDPStrategy reads torch DDP's logging data: not ours
            self.model = self.lightning_module
        super().teardown()

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Lightning gives the train loader its saved state only on a resume inside an epoch. From a checkpoint
        # written at an epoch's end it starts the next epoch afresh, and a DistributedSampler's set_epoch gives
        # that epoch's order; the Balancer's order, step count and plan are its state, restored in _step_loader.
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader", [])
        state = states[0] if len(states) == 1 else None
        self._resumed_loader_state = state if isinstance(state, dict) and "step_in_epoch" in state else None
        return checkpoint

    # -- the data ------------------------------------------------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        stage = self.lightning_module.trainer.state.stage
        if not isinstance(dataloader, DataLoader):
            return super().process_dataloader(dataloader)
        if stage == RunningStage.TRAINING:
            return self._step_loader(dataloader)
        return dataloader  # evaluation as with DDP: Note [Lightning]

    def _new_balancer(self, model: hsync.WeightedDDP, examples: int, config: hsync.BalanceConfig) -> hsync.Balancer:
        # One place that builds it, for a benchmark's subclass to give it another clock.
        return hsync.Balancer(model, examples, config)

    def _step_loader(self, loader: DataLoader) -> StepLoader:
        # Lightning's own samplers only: a DistributedSampler it made of a RandomSampler or SequentialSampler (its
        # DistributedSamplerWrapper, around a sampler of the user's, is one too, by subclass).
        if type(loader.sampler) not in (DistributedSampler, RandomSampler, SequentialSampler) or (
                loader.batch_size is None):
            raise ValueError("HsyncStrategy splits the train dataloader's examples among ranks itself: give it a "
                             "DataLoader with a batch_size and no sampler or batch_sampler of its own (found "
                             f"sampler {_sampler_name(loader.sampler)}, batch_size {loader.batch_size})")
        world = self.world_size
        # The order Lightning's DistributedSampler would give: its seed (seed_everything's), shuffled or not.
        shuffle = getattr(loader.sampler, "shuffle", not isinstance(loader.sampler, SequentialSampler))
        seed = getattr(loader.sampler, "seed", int(os.environ.get("PL_GLOBAL_SEED", 0)))
        config = self.balance or hsync.BalanceConfig(
            global_batch_size=loader.batch_size * self._micro_batches_per_step * world,
            micro_batch_limit=loader.batch_size if self._micro_batches_per_step > 1 else None,
            drop_last=loader.drop_last, seed=seed, shuffle=shuffle)
        data = (len(loader.dataset), config)
        # A first fit(), another module, or other data (reload_dataloaders_every_n_epochs): a Balancer of its own.
        if self.balancer is None or self.balancer.model is not self.model or self._balanced_data != data:
            self.balancer = self._new_balancer(self.model, len(loader.dataset), config)
            self._balanced_data = data
        if self._resumed_loader_state is not None:
            self.balancer.load_state_dict(self._resumed_loader_state)
            self._resumed_loader_state = None
        workers = loader.num_workers
        options = dict(num_workers=workers, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
                       persistent_workers=loader.persistent_workers, timeout=loader.timeout)
        if workers > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        return StepLoader(loader.dataset, self.balancer, loader.collate_fn, **options)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, MicroBatches):  # the module's transfer hooks see each micro-batch as its batch
            return MicroBatches(super(HsyncStrategy, self).batch_to_device(micro, device, dataloader_idx)
                                for micro in batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- evaluation ----------------------------------------------------------------------------------

    # Ranks evaluate different numbers of batches (no example twice), so no forward may be a collective:
    # the module runs itself, not through WeightedDDP (whose forward would broadcast rank 0's buffers),
    # after the buffers are made rank 0's once.
    def on_validation_start(self) -> None:
        self._buffers_from_rank_0()
        super().on_validation_start()

    def on_test_start(self) -> None:
        self._buffers_from_rank_0()
        super().on_test_start()

    def on_predict_start(self) -> None:
        self._buffers_from_rank_0()
        super().on_predict_start()

    def _buffers_from_rank_0(self) -> None:
        if isinstance(self.model, hsync.WeightedDDP) and self.model.broadcast_buffers:
            self.model.sync_buffers()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # -- the step ------------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, *rest = args
        if not isinstance(batch, MicroBatches):
            if _holds_micro_batches(batch):  # refused on every rank alike, at the first step, before its collectives
                raise ValueError("HsyncStrategy balances one train dataloader, and the module's train_dataloader "
                                 "returned several (a dict or a list of them); combine their datasets into one "
                                 "(torch.utils.data.ConcatDataset, or a Dataset whose item holds one of each)")
            return super().training_step(*args, **kwargs)
        *leading, last = batch
        if leading:  # the zeroing Lightning does after this training_step, brought forward (see below)
            for p in self.lightning_module.parameters():
                p.grad = None
        self._leading_micro_batch = True
        try:
            for micro in leading:
                self._logs_weigh(micro)
                output = self._take_weight(self._skipped_as_weightless(super().training_step(micro, *rest, **kwargs)))
                loss = output["loss"] if isinstance(output, dict) else output
                self.backward(loss, None)
        finally:
            self._leading_micro_batch = False
        # Lightning zeroes the gradients between this training_step and the backward of what it returns: the
        # leading micro-batches' gradients step aside meanwhile (references, not copies) and come back in
        # backward().
        self._set_aside = [(p, p.grad) for p in self.lightning_module.parameters() if leading and p.grad is not None]
        for p, _ in self._set_aside:
            p.grad = None
        self._last_micro_batch_examples = self._logs_weigh(last)
        try:
            return self._take_weight(self._skipped_as_weightless(super().training_step(last, *rest, **kwargs)))
        finally:
            self._last_micro_batch_examples = None

    def _skipped_as_weightless(self, output: Any) -> Any:
        """A training_step that returns None skips its batch in Lightning. Every rank must still run each of its
        micro-batches' backward (the step's collectives), so a skipped one runs with weight 0: gradients of
        zeros that count for nothing in the weighted mean, as if the batch had not been there."""
        if output is not None:
            return output
        self._weight = 0
        trainable = [p for p in self.lightning_module.parameters() if p.requires_grad]
        return torch.stack([p.sum() for p in trainable]).sum() * 0

    def _logs_weigh(self, micro: Any) -> int | None:
        """Lightning weighs a value logged for the epoch by its batch's size, which it would infer from the whole
        step's item (the first micro-batch's): each micro-batch weighs its own examples (none for a filler, another
        rank's examples run with weight 0). Returns that size (None: no tensor in it to tell)."""
        results = self.lightning_module.trainer._results
        try:
            examples = 0 if self.balancer.filler else extract_batch_size(micro)
        except MisconfigurationException:  # no tensor to tell: Lightning's own inference, if a log asks for it
            examples = None
        results.batch, results.batch_size = micro, examples
        return examples

    def _take_weight(self, output: Any) -> Any:
        """The module's training_step may return {"loss": ..., "weight": ...}: what its loss is a mean over."""
        if isinstance(output, dict) and "weight" in output:
            output = dict(output)
            self._weight = output.pop("weight")
        return output

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.balancer is None:  # not a balanced train loader (manual use): Lightning's own
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        for p, grad in self._set_aside:
            p.grad = grad
        self._set_aside = []
        self.pre_backward(closure_loss)
        scaled = self.precision_plugin.pre_backward(closure_loss, module)
        weight, self._weight = self._weight, None
        stats = self.balancer.backward(scaled, weight=weight)
        if stats is not None:
            self.step_stats = stats
            if stats.weight == 0:
                # Every training_step of the step returned None, on every rank: as plain Lightning skips such a
                # step, without gradients the optimizer moves nothing (a weight decay or momentum would, on zeros).
                # (The weight is on the host already: no wait for the device here.)
                for p in module.parameters():
                    p.grad = None
        scaled = self.precision_plugin.post_backward(scaled, module)
        self.post_backward(scaled)
        return scaled

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._leading_micro_batch:  # Note [Lightning]: synced at the step's last micro-batch
            return tensor
        op = str(reduce_op).lower().rsplit(".", 1)[-1]  # "mean", or ReduceOp.SUM's "RedOpType.SUM"
        if not (isinstance(tensor, torch.Tensor) and op in ("sum", "mean", "avg") and group is None):
            with self._waiting_for_peers():
                return super().reduce(tensor, group, reduce_op)
        # Outside fit() (trainer.validate() or test(), before or after it) the module is not wrapped: the world's
        # channel, as DDPStrategy's reduce takes the world's group.
        channel = (Channels.of_model(self.model) if isinstance(self.model, hsync.WeightedDDP)
                   else Channels.of_group(device=self.root_device))
        dtype = tensor.dtype if tensor.is_floating_point() else torch.float64
        examples = self._last_micro_batch_examples
        with self._waiting_for_peers():  # a log's sync_dist: not the rank's own work
            # Through hsync's channel, under its deadline; summed in float64: Lightning's divides an integer sum
            # by the ranks in integers, and a mean metric's count of examples (its denominator) would lose its
            # fraction where ranks ran different numbers of them.
            if op != "sum" and examples is not None and tensor.numel() == 1:
                # A value of the step (on_step), logged at its last micro-batch: each rank's weighs that
                # micro-batch's examples, as Lightning weighs batches within a rank, since the ranks' differ.
                pair = torch.stack([tensor.detach().double().reshape(()) * examples,
                                    torch.full((), float(examples), dtype=torch.float64, device=tensor.device)])
                value, weight = channel.all_reduce_sum(pair, "a logged value's sync_dist").tolist()
                return torch.full(tensor.shape, value / weight if weight else math.nan, dtype=dtype,
                                  device=tensor.device)
            total = channel.all_reduce_sum(tensor.double(), "a logged value's sync_dist")
        if op == "sum":
            return total.to(tensor.device, tensor.dtype)
        return (total / self.world_size).to(tensor.device, dtype)


def _sampler_name(sampler: Any) -> str:
    """The train sampler's name, the user's own named where Lightning wrapped it in a DistributedSamplerWrapper."""
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    return f"{type(inner).__name__} (in Lightning's {type(sampler).__name__})" if inner is not None \
        else type(sampler).__name__


def _holds_micro_batches(batch: Any) -> bool:
    """Whether a loader's item holds steps of hsync's (a CombinedLoader's dict or list of several loaders')."""
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, list | tuple) else ()
    return any(isinstance(value, MicroBatches) for value in values)


check_framework_version(lightning)
if HsyncStrategy.strategy_name not in StrategyRegistry:
    HsyncStrategy.register_strategies(StrategyRegistry)
