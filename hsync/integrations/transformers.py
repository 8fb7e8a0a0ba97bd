"""transformers.Trainer with hsync: each rank's share of every global batch planned from its measured
speed, and the gradient the exact weighted mean over ranks (pip install hsync[transformers]).

    from hsync.integrations.transformers import BalancingArguments, Trainer

    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=collator,
                      balancing=BalancingArguments())  # everything else exactly as transformers.Trainer
    trainer.train()

Note [Trainer]
Trainer wraps the model in torch's DDP (through Accelerate), gives every rank the same number of
examples, and groups gradient_accumulation_steps batches into a step. This subclass changes the three
seams where that happens and leaves the rest of Trainer as it is:
- the model is wrapped in hsync.WeightedDDP (_wrap_model), which Trainer then keeps out of
  accelerator.prepare, so no DDP goes around it; the optimizer is prepared as usual;
- the train dataloader yields one item per optimizer step: this rank's micro-batches of that step, as
  an hsync.Balancer splits it, each collated by the Trainer's collator in the DataLoader's workers. The
  global batch is per_device_train_batch_size x gradient_accumulation_steps x ranks, and a micro-batch
  holds at most per_device_train_batch_size examples (of the longest length, when examples are
  balanced by tokens). Trainer sees gradient_accumulation_steps 1: one item, one step, so its counts
  of steps, epochs, schedules and its progress bar stay right;
- training_step runs the item's micro-batches through Balancer.backward, each weighted by the items
  its loss is a mean over (its labels other than -100, as Trainer counts num_items_in_batch; its
  examples without labels), and returns the step's loss over every rank.
Evaluation, predictions, metrics, callbacks, logging and save_model are Trainer's own: the model they
see (self.model) is the plain model, so a saved folder loads with from_pretrained.
With BalancingArguments.shard_optimizer, four more seams: create_optimizer wraps Trainer's optimizer
class and groups in hsync.ShardedOptimizer; _prepare_for_training keeps Accelerate from moving its
state (a state_dict of it is a collective); _clip_grad_norm and _get_grad_norm take the norm over every
rank's shard; _save_optimizer_and_scheduler gathers the whole state first, on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hsync
from hsync.integrations._loaders import MicroBatches, StepLoader
from hsync.integrations._world import check_framework_version, refuse_a_wrapped_model, wrap


@dataclass
class BalancingArguments:
    """How the hsync Trainer splits each global batch among ranks (the rest comes from TrainingArguments)."""

    global_batch_size: int | None = None
    """Examples per optimizer step over every rank. None: per_device_train_batch_size x
    gradient_accumulation_steps x ranks. Set it to resume a run on another number of ranks with the same
    global batches."""
    rank_batch_sizes: Sequence[int] | None = None
    """A fixed share of every global batch per rank, adding up to it; None: planned from measured speeds."""
    by_tokens: bool | None = None
    """Balance by tokens (each example's len(input_ids)) rather than examples. None: when the dataset has
    input_ids or TrainingArguments groups by length (train_sampling_strategy="group_by_length", or
    group_by_length before transformers 5.23)."""
    warmup_steps: int = 2
    """Steps not measured at the start (BalanceConfig.warmup_steps)."""
    probe_steps: int = 3
    """Steps per probe split, three splits, before the first plan (BalanceConfig.probe_steps)."""
    replan_every: int = 25
    """Steps between two fits of the ranks' speeds (BalanceConfig.replan_every)."""
    min_gain: float = 0.04
    """A new split is taken only if it predicts steps at least this much shorter (BalanceConfig.min_gain)."""
    shard_optimizer: bool = False
    """Keep the optimizer's state sharded across the ranks by their memory (hsync.ShardedOptimizer over the
    optimizer TrainingArguments choose, with its parameter groups): the same updates, each rank holding its
    share. Checkpoints hold the whole state, so a run resumes with or without it."""


class Trainer(transformers.Trainer):
    """transformers.Trainer whose ranks train through hsync (Note [Trainer]): constructed as Trainer is, with
    `balancing` besides. Needs torchrun (or another launcher's RANK and WORLD_SIZE) for more than one rank."""

    def __init__(self, *args: Any, balancing: BalancingArguments | None = None, **kwargs: Any) -> None:
        check_versions()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ValueError("hsync.integrations.transformers.Trainer needs its TrainingArguments (args=...)")
        refuse_what_cannot_weigh(training_args)
        refuse_a_wrapped_model(kwargs.get("model", args[0] if args else None),
                               "hsync.integrations.transformers.Trainer")
        self.balancing = balancing or BalancingArguments()
        if self.balancing.shard_optimizer and training_args.fp16:
            # A plain loop's GradScaler steps a ShardedOptimizer alike on every rank
            # (Note [A non-finite step on every rank]); the Trainer's unscaling and clipping
            # of one has yet to be tested on a GPU.
            raise ValueError("hsync.integrations.transformers.Trainer: BalancingArguments(shard_optimizer=True) "
                             "does not take fp16's GradScaler; use bf16, or no sharding")
        # Trainer counts one dataloader item as one step (Note [Trainer]); the accumulation steps become
        # micro-batches of the Balancer's.
        self.micro_batches_per_step = training_args.gradient_accumulation_steps
        training_args = copy.copy(training_args)
        training_args.gradient_accumulation_steps = 1
        # A resume goes on where the Balancer's state says (its own checkpoint file): Trainer's skipping of
        # the batches already trained would split them again, and train none of them.
        training_args.ignore_data_skip = True
        if "args" in kwargs:
            kwargs["args"] = training_args
        else:
            args = (args[0], training_args, *args[2:])
        super().__init__(*args, **kwargs)
        self.weighted_model: nn.Module | None = None  # the WeightedDDP, compiled with torch_compile
        self.weighted_ddp: hsync.WeightedDDP | None = None
        self.sharded_optimizer: hsync.ShardedOptimizer | None = None  # with BalancingArguments.shard_optimizer
        self.balancer: hsync.Balancer | None = None
        self._resume_from: str | None = None
        self._loss_shifts_labels = shifts_labels(self.model)
        # First, so that every other callback, and the logs, see the epoch it sets.
        self.callback_handler.callbacks.insert(0, _EpochOfTheBalancer(self))

    # -- the model -----------------------------------------------------------------------------------

    def _weighted(self) -> nn.Module:
        if self.weighted_model is None:
            args = self.args
            find_unused = args.ddp_find_unused_parameters
            if find_unused is None:  # TrainingArguments' documented default
                find_unused = not args.gradient_checkpointing
            options: dict[str, Any] = {"find_unused_parameters": find_unused}
            if args.ddp_bucket_cap_mb is not None:
                options["bucket_cap_mb"] = args.ddp_bucket_cap_mb
            # A PreTrainedModel's .device, for any nn.Module Trainer takes: where its parameters are.
            device = next(self.model.parameters()).device
            if device.type == "cuda":
                options["device_ids"] = [device.index]
            weighted = self.weighted_ddp = wrap(self.model, device, **options)
            if args.torch_compile:  # what Accelerate's prepare would have done to the model it wrapped
                weighted = torch.compile(weighted, backend=args.torch_compile_backend or "inductor",
                                         mode=args.torch_compile_mode)
            self.weighted_model = weighted
        return self.weighted_model

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None) -> nn.Module:
        # Not the model Trainer was given: Trainer then keeps it out of accelerator.prepare (no DDP around it).
        return self._weighted() if training else super()._wrap_model(model, training, dataloader)

    # -- the optimizer -------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if not self.balancing.shard_optimizer or self.optimizer is not None:
            return super().create_optimizer(model)
        plain = super().create_optimizer(model)  # Trainer's groups and settings; no state until a step
        optimizer_class, defaults = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        self._weighted()
        self.optimizer = self.sharded_optimizer = hsync.ShardedOptimizer(
            self.weighted_ddp, optimizer_class, params=[dict(group) for group in plain.param_groups], **defaults)
        return self.optimizer

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        if not self.balancing.shard_optimizer:  # the optimizer is created in there
            return super()._prepare_for_training(*args, **kwargs)
        # Accelerate's device placement moves an optimizer's state through a state_dict, which for a sharded one
        # is a collective gathering of the whole state; its state is already where its parameters are.
        with _assigned(self.accelerator, "device_placement", False):
            return super()._prepare_for_training(*args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        if self.sharded_optimizer is None:
            return super()._clip_grad_norm(model)
        return self.sharded_optimizer.clip_grad_norm_(self.args.max_grad_norm)  # over every rank's shard

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> Any:
        if self.sharded_optimizer is not None and grad_norm is None:  # a rank holds its own gradients only
            grad_norm = self.sharded_optimizer.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_optimizer is not None:
            # The whole state, gathered on every rank that writes it (save_on_each_node: one a node); the
            # gather is the same collective whichever ranks keep it.
            self.sharded_optimizer.consolidate_state_dict(to=self.args.process_index if self.args.should_save else 0)
        super()._save_optimizer_and_scheduler(output_dir)

    # -- the data ------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("hsync.integrations.transformers.Trainer: training requires a train_dataset")
        dataset = self.train_dataset
        collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("hsync.integrations.transformers.Trainer balances a dataset of known size; an "
                            "IterableDataset cannot be split ahead of time")
        if hasattr(dataset, "column_names"):  # a datasets.Dataset: its unused columns go, as in Trainer
            dataset = self._remove_unused_columns(dataset, description="training")
        costs = self._example_costs(dataset)
        args = self.args
        per_device = self._train_batch_size
        config = hsync.BalanceConfig(
            global_batch_size=self.get_total_train_batch_size(args),
            rank_batch_sizes=self.balancing.rank_batch_sizes,
            micro_batch_limit=per_device * (max(costs) if isinstance(costs, list) else 1),
            warmup_steps=self.balancing.warmup_steps, probe_steps=self.balancing.probe_steps,
            replan_every=self.balancing.replan_every, min_gain=self.balancing.min_gain,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
            drop_last=args.dataloader_drop_last)
        if self.balancer is None:
            self.balancer = self._new_balancer(self._weighted(), costs, config)
            if self._resume_from is not None:
                self.balancer.load_state_dict(load_balancer_state(self._resume_from))
        workers = args.dataloader_num_workers
        return StepLoader(dataset, self.balancer, collate, num_workers=workers, pin_memory=args.dataloader_pin_memory,
                          persistent_workers=workers > 0 and args.dataloader_persistent_workers,
                          prefetch_factor=args.dataloader_prefetch_factor)

    def _new_balancer(self, model: hsync.WeightedDDP, examples: int | list[float],
                      config: hsync.BalanceConfig) -> hsync.Balancer:
        # One place that builds it, for a benchmark's subclass to give it another clock.
        return hsync.Balancer(model, examples, config)

    def _example_costs(self, dataset: Dataset) -> int | list[float]:
        """The dataset's size, or each example's tokens where examples are balanced by tokens."""
        by_tokens = self.balancing.by_tokens
        first = dataset[0]
        has_ids = isinstance(first, dict) and "input_ids" in first
        if by_tokens is None:
            by_tokens = has_ids or groups_by_length(self.args)
        if not by_tokens:
            return len(dataset)
        if not has_ids:
            raise ValueError("hsync.integrations.transformers.Trainer: balancing by tokens needs examples with "
                             "input_ids; set BalancingArguments(by_tokens=False)")
        return [float(len(dataset[i]["input_ids"])) for i in range(len(dataset))]

    def get_total_train_batch_size(self, args: transformers.TrainingArguments) -> int:
        if self.balancing.global_batch_size is not None:
            return self.balancing.global_batch_size
        return self._train_batch_size * self.micro_batches_per_step * max(1, args.world_size)

    # -- checkpoints ---------------------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.balancer is not None and self.args.should_save:  # the same state on every rank: rank 0 writes it
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            torch.save(self.balancer.state_dict(), os.path.join(folder, BALANCER_STATE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._resume_from = resume_from_checkpoint

    # -- the step ------------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: list[dict[str, Any]],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """This rank's micro-batches of one step through the Balancer (Note [Trainer]); the step's loss over
        every rank."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        stats = None
        for micro_batch in inputs:
            weight = self._items(micro_batch)  # counted on the host, before the copy: no wait for a GPU
            micro_batch = self._prepare_inputs(micro_batch)
            with self.accelerator.autocast(), self.compute_loss_context_manager():
                loss = self.compute_loss(model, micro_batch)
            if self.accelerator.scaler is not None:  # fp16: scaled as accelerator.backward scales it
                loss = self.accelerator.scaler.scale(loss)
            stats = self.balancer.backward(loss, weight=weight)
        if stats is None:
            raise RuntimeError("hsync.integrations.transformers.Trainer: a step ended before its last micro-batch")
        scale = self.accelerator.scaler.get_scale() if self.accelerator.scaler is not None else 1.0
        # torch.full, not torch.tensor: that copies from pageable memory, and the host would wait for the device.
        return torch.full((), stats.loss / scale, device=self.args.device)

    def _prepare_input(self, data: Any) -> Any:
        # Trainer's copies each tensor with the host waiting for the device's queue (every micro-batch of a step,
        # behind the one before); the balanced loader pins its batches, which are copied without that wait.
        if isinstance(data, torch.Tensor) and data.is_pinned():
            return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        # An evaluation batch's loss as one process computes it, averaged over the examples of every rank as
        # there. Trainer's own, across ranks, is multiplied by their number, which only a model dividing its
        # loss by every rank's tokens undoes: a classifier's evaluation loss came out that many times too high.
        with _assigned(self.args, "average_tokens_across_devices", False):
            return super().prediction_step(*args, **kwargs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # A step is this rank's micro-batches: counted as one batch, whose tensors hold every micro-batch's
        # elements (flattened, as only sums and sizes are counted), in one gather a step on every rank.
        if isinstance(inputs, MicroBatches) and self.args.include_num_input_tokens_seen != "no":
            # Only what Trainer counts: the model's main input, and the attention mask for non-padding tokens.
            counted = {getattr(self.model, "main_input_name", "input_ids"), "attention_mask"}
            inputs = {name: torch.cat([micro[name].reshape(-1) for micro in inputs]) for name in counted
                      if all(isinstance(micro.get(name), torch.Tensor) for micro in inputs)}
        super()._track_num_input_tokens(inputs)

    def floating_point_ops(self, inputs: Any) -> int:
        if isinstance(inputs, MicroBatches):
            return sum(super(Trainer, self).floating_point_ops(micro) for micro in inputs)
        return super().floating_point_ops(inputs)

    def _items(self, micro_batch: dict[str, Any]) -> float:
        """What the micro-batch's loss is a mean over: its labels other than -100 (shifted for a causal LM, as
        Trainer counts num_items_in_batch), or its examples."""
        labels = micro_batch.get("shift_labels", micro_batch.get("labels"))
        if isinstance(labels, torch.Tensor):
            if "shift_labels" not in micro_batch and self._loss_shifts_labels:
                labels = labels[..., 1:]
            return float(labels.ne(-100).sum())
        first = next((v for v in micro_batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if first is None:
            raise ValueError("hsync.integrations.transformers.Trainer: a micro-batch without tensors has no size")
        return float(len(first))


@contextlib.contextmanager
def _assigned(holder: Any, name: str, value: Any) -> Iterator[None]:
    """`holder.name` is `value` inside the block, and what it was again after it."""
    before = getattr(holder, name)
    setattr(holder, name, value)
    try:
        yield
    finally:
        setattr(holder, name, before)


class _EpochOfTheBalancer(transformers.TrainerCallback):
    """Sets state.epoch from the Balancer's position after each step. Trainer counts it from the steps its loop ran
    in this epoch, which after a resume in the middle of one (ignore_data_skip: Note [Trainer]) leaves out those
    trained before: the epoch went back at the first step resumed, and ended short."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.balancer is not None:
            state.epoch = self.trainer.balancer.epoch_progress


def shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss is a mean over its labels shifted by one (a causal LM's: position 0 is never a
    target). Trainer asks only the model's loss_type, which GPT-2's and other causal LMs' leave unset (their
    loss is then ForCausalLMLoss all the same): under equal splits its count cancels out, but a rank's weight
    that counts position 0 skews the weighted mean. So a model registered as a causal LM shifts too."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's, as Trainer's
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):  # the decoder's inputs come shifted
        return False
    loss_type = getattr(model, "loss_type", None)
    if loss_type is not None:
        return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss
    causal = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
              for name in ([names] if isinstance(names, str) else names)}
    return type(model).__name__ in causal


BALANCER_STATE = "hsync_balancer.pt"


def groups_by_length(args: transformers.TrainingArguments) -> bool:
    """Whether Trainer would batch examples of similar lengths (an argument renamed in transformers 5.23)."""
    return (getattr(args, "train_sampling_strategy", None) == "group_by_length"
            or bool(getattr(args, "group_by_length", False)))


def load_balancer_state(checkpoint: str) -> dict:
    """The Balancer's state in a checkpoint folder of the hsync Trainer."""
    path = os.path.join(checkpoint, BALANCER_STATE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hsync.integrations.transformers.Trainer: {checkpoint} has no {BALANCER_STATE}, "
                                "where the run stood in its data; resume from a checkpoint this Trainer wrote")
    return torch.load(path, weights_only=True)


def check_versions() -> None:
    """Refuses a transformers release outside the tested range, and a run that is distributed in part."""
    check_framework_version(transformers)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" not in os.environ:
        raise RuntimeError("hsync.integrations.transformers.Trainer: WORLD_SIZE is set without RANK; "
                           "start the ranks with torchrun")


def refuse_what_cannot_weigh(args: transformers.TrainingArguments) -> None:
    """Options under which ranks do not each compute whole gradients of the whole model: refused before any
    work, on every rank alike (each reads the same arguments)."""
    for option in ("deepspeed", "fsdp"):
        if getattr(args, option, None):
            raise ValueError(f"hsync.integrations.transformers.Trainer cannot weigh gradients under {option} "
                             f"(TrainingArguments.{option}): shards of a model are not whole gradients; drop "
                             f"{option}, or use transformers.Trainer")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != max(1, args.world_size):
        hint = " (without a GPU, set use_cpu=True: transformers then sees the launch)" if not args.use_cpu else ""
        raise ValueError(f"hsync.integrations.transformers.Trainer: the launcher started {launched} processes but "
                         f"TrainingArguments see {args.world_size}{hint}")
    if args.n_gpu > 1:
        raise ValueError("hsync.integrations.transformers.Trainer runs one process per GPU (torchrun), not "
                         f"torch.nn.DataParallel over {args.n_gpu} GPUs in one process")
