"""Accelerate with hsync: prepare() gives a WeightedDDP and a balanced loader, backward() the weighted step
(pip install hsync[accelerate]).

    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")             # Accelerate's arguments
    model, optimizer = accelerator.prepare(model, optimizer)        # model: an hsync.WeightedDDP
    balancer = hsync.Balancer(model, len(train), hsync.BalanceConfig(global_batch_size=64))
    loader = accelerator.prepare(DataLoader(train, batch_sampler=balancer, collate_fn=collate))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:                                       # on the device, this rank's micro-batches
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)                         # weight: the micro-batch's examples
                optimizer.step()                                   # steps once the global batch is done
                scheduler.step()
                optimizer.zero_grad()

Note [Accelerate]
Accelerate wraps a model in torch's DDP, shards every DataLoader's batches across ranks, and counts
gradient_accumulation_steps micro-batches to a step. Here prepare_model() prepares the model as
Accelerate prepares one for evaluation (device, autocast, compilation: everything but DDP) and wraps
it in hsync.WeightedDDP; a DataLoader whose batch_sampler is an hsync.Balancer is not sharded again
but moves its batches to the device; and the Balancer, not a count, says when a step ends: backward()
runs Balancer.backward and sets Accelerate's sync_gradients to whether the global batch is complete,
which is what the prepared optimizer and scheduler step on; accumulate() enters no no_sync of its own
(the Balancer runs a step's other micro-batches under no_sync) and leaves sync_gradients as the last
backward set it, so that a zero_grad() at the top of its body clears nothing mid-step; clip_grad_norm_
mid-step does nothing. So gradient_accumulation_steps stays 1 (a
rank's share runs in micro-batches by the Balancer's micro_batch_limit), and the Balancer is saved
and loaded with save_state and load_state. The balanced loader's length is the number of global steps on
any number of ranks, so a prepared scheduler steps once per global step, as in one process (Accelerate
steps it once per rank, for loaders whose length shrinks with the ranks): a schedule sized from
len(loader) or Balancer.steps_per_epoch ends where it would in one process.

With Accelerator(shard_optimizer=True), prepare() puts an hsync.ShardedOptimizer of the optimizer's class,
groups (the same dicts, which a scheduler built on it sets) and settings in the optimizer's place, over the
prepared model (docs/sharding.md), without device
placement (which moves a state through a state_dict: for a sharded one, a gathering of the whole state);
clip_grad_norm_ clips over every rank's shard, and save_state gathers the whole state on every rank first.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, recursively_apply, send_to_device

import hsync
from hsync.integrations._world import check_framework_version, refuse_a_wrapped_model, wrap
from hsync.sharding.shares import MemoryBudget
from hsync.stats import StepStats


class BalancedLoader:
    """A DataLoader over an hsync.Balancer, as Accelerator.prepare returns it: this rank's micro-batches, moved
    to the device; not sharded again."""

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, non_blocking: bool) -> None:
        self.loader, self.device, self.non_blocking = loader, device, non_blocking
        self.balancer: hsync.Balancer = loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> torch.utils.data.Dataset:
        return self.loader.dataset

    @property
    def total_batch_size(self) -> int:
        """Examples in one optimizer step over every rank, as Accelerate's sharded loaders say."""
        return self.balancer.config.global_batch_size

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def set_epoch(self, epoch: int) -> None:
        self.balancer.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        # The DataLoader's other attributes (batch_size is None there: its batch_sampler sizes the batches).
        if name == "loader":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator whose ranks train through hsync (Note [Accelerate]); constructed as it is, and with
    `shard_optimizer=True` the prepared optimizer's state sharded by each rank's `memory_budget`
    (hsync.ShardedOptimizer's argument; None: measured on a GPU, equal on the CPU)."""

    def __init__(self, *args: Any, shard_optimizer: bool = False, memory_budget: MemoryBudget = None,
                 **kwargs: Any) -> None:
        check_framework_version(accelerate)
        launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and not args and "cpu" not in kwargs and not torch.accelerator.is_available():
            # Launched as several processes on a machine without GPUs, Accelerate runs each as a job of its own
            # unless told cpu=True (as `accelerate launch --cpu` tells it), while hsync's ranks train together.
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        if launched > 1 and self.num_processes != launched:
            raise ValueError(f"hsync.integrations.accelerate: launched as {launched} processes, but "
                             f"Accelerate runs as {self.num_processes} ({self.distributed_type}), so each rank would "
                             "take itself for the main process; on CPUs pass Accelerator(cpu=True)")
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
            raise ValueError(f"hsync.integrations.accelerate cannot weigh gradients under {self.distributed_type}: "
                             "shards of a model are not whole gradients; use accelerate.Accelerator")
        if self.gradient_accumulation_steps != 1:
            raise ValueError("hsync.integrations.accelerate: gradient_accumulation_steps must stay 1; the Balancer "
                             "runs a rank's share in micro-batches (BalanceConfig.micro_batch_limit) and says when "
                             "a step ends")
        if shard_optimizer and self.mixed_precision == "fp16":
            # A plain loop's GradScaler steps a ShardedOptimizer alike on every rank
            # (Note [A non-finite step on every rank]); Accelerate's unscaling and clipping
            # of one has yet to be tested on a GPU.
            raise ValueError("hsync.integrations.accelerate: shard_optimizer=True does not take fp16's GradScaler; "
                             "use bf16, or no sharding")
        self.shard_optimizer, self.memory_budget = shard_optimizer, memory_budget
        self.sharded_optimizer: hsync.ShardedOptimizer | None = None
        """With shard_optimizer, the hsync.ShardedOptimizer prepare() made."""
        self._weighted_models: list[hsync.WeightedDDP] = []  # Accelerate's _models holds the bare modules
        self.balancer: hsync.Balancer | None = None
        self.step_stats: StepStats | None = None
        """The last complete step's StepStats (examples over every rank, the non-finite flag)."""
        self.step_loss: float | None = None
        """The last complete step's loss over every rank (step_stats.loss, less float16's loss scale)."""

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if evaluation_mode or isinstance(model, hsync.WeightedDDP):
            return super().prepare_model(model, device_placement, evaluation_mode)
        refuse_a_wrapped_model(model, "hsync.integrations.accelerate.Accelerator.prepare")
        # Everything Accelerate does to a model but DDP, then hsync's wrapper in its place; a model with nothing
        # to train (a distillation's teacher) stays unwrapped, as Accelerate leaves it.
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)
        if not any(p.requires_grad for p in model.parameters()):
            return prepared
        self._refuse_a_second_trained_model(extra=1)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        options = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        weighted = wrap(prepared, self.device, device_ids=device_ids, **options)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(weighted)
        self._weighted_models.append(weighted)
        return weighted

    def _refuse_a_second_trained_model(self, extra: int = 0) -> None:
        """A Balancer weighs one model's backward: a second trained model would reduce its gradients with DDP's
        equal weights beside it, and its ranks run different numbers of micro-batches."""
        trained = len(self._weighted_models) + extra
        if self.balancer is not None and trained > 1:
            raise ValueError(f"hsync.integrations.accelerate: a Balancer weighs the gradients of one prepared model, "
                             f"and {trained} with parameters to train were prepared; put the trained parts in one "
                             "nn.Module (say nn.ModuleDict(encoder=encoder, head=head)) and prepare that")

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if not self.shard_optimizer:
            return super().prepare_optimizer(optimizer, device_placement)
        if not isinstance(optimizer, hsync.ShardedOptimizer):
            params = {p for group in optimizer.param_groups for p in group["params"]}
            models = [m for m in self._weighted_models if params & set(m.parameters())]
            if len(models) != 1:
                raise ValueError("hsync.integrations.accelerate: shard_optimizer=True needs the optimizer prepared "
                                 "with the one model it steps, in the same prepare() call or after it")
            # The optimizer's own groups, not copies: an LR scheduler built on it (before prepare(), as Accelerate's
            # recipes build it) sets the learning rates the ShardedOptimizer steps with.
            optimizer = hsync.ShardedOptimizer(models[0], type(optimizer), memory_budget=self.memory_budget,
                                               params=optimizer.param_groups, **_constructor_defaults(optimizer))
        self.sharded_optimizer = optimizer
        return super().prepare_optimizer(optimizer, device_placement=False)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        prepared = super().prepare_scheduler(scheduler)
        self._count_global_steps()
        return prepared

    def _count_global_steps(self) -> None:
        """With a Balancer, every rank's loader yields the global steps, as one process's would: a prepared
        scheduler steps once per global step (Accelerate's split_batches count), not once per rank."""
        if self.balancer is not None:
            for scheduler in self._schedulers:
                scheduler.split_batches = True

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Accelerate's, over every rank's shard with shard_optimizer; in the middle of a step (a micro-batch that
        is not this rank's last) it does nothing and returns None, as with DeepSpeed: the gradients are a partial
        sum there, so a loop that clips after every backward, as at gradient_accumulation_steps=1, clips the
        step's whole gradient once."""
        if self.balancer is not None and self.balancer.step_begun:
            return None
        if self.sharded_optimizer is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return self.sharded_optimizer.clip_grad_norm_(max_norm, norm_type)  # over every rank's shard

    def _do_sync(self) -> None:
        """accumulate()'s entry. Accelerate's count (gradient_accumulation_steps=1) would say that every micro-batch
        ends a step, and a zero_grad() at the top of the body would then drop the step's earlier micro-batches:
        with a Balancer, sync_gradients reads there as it does after the previous backward (True at a step's
        start only), until backward() says whether this micro-batch ended the step."""
        super()._do_sync()
        if self.balancer is not None:
            self.gradient_state._set_sync_gradients(not self.balancer.step_begun)

    def gather(self, tensor: Any) -> Any:
        """Accelerate's, for tensors whose first dimension differs across ranks, as a Balancer's micro-batches do
        (gloo ended the process on the sizes' mismatch): each padded to the largest, gathered, and cut back to
        every rank's own, in rank order."""
        if self.balancer is None:
            return super().gather(tensor)
        return recursively_apply(self._gather_uneven, tensor)

    def _gather_uneven(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return super().gather(tensor)
        sizes = super().gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        parts = super().gather(padded).split(max(sizes))
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    def no_sync(self, model: torch.nn.Module) -> Any:
        """Accelerate's, but for the Balancer's model, whose backward() runs every micro-batch but this rank's
        last of a step under no_sync itself (accumulate() enters this one wherever sync_gradients is False)."""
        if self.balancer is not None and model is self.balancer.model:
            return contextlib.nullcontext()
        return super().no_sync(model)

    def free_memory(self, *objects: Any) -> Any:
        """Accelerate's, and hsync's references too (the models, the Balancer, the sharded optimizer), so that a
        retry (find_executable_batch_size) prepares anew."""
        if self.balancer is not None and self.balancer in self._custom_objects:
            self._custom_objects.remove(self.balancer)
        self._weighted_models, self.balancer, self.sharded_optimizer = [], None, None
        self.step_stats, self.step_loss = None, None
        return super().free_memory(*objects)

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        if self.sharded_optimizer is not None:  # every rank reads state_dict(): the whole state on each
            self.sharded_optimizer.consolidate_state_dict(to=self.process_index)
        return super().save_state(*args, **kwargs)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, BalancedLoader):
            if num_batches:  # Accelerate's recipe for a resume, which here would skip the batches twice
                raise ValueError("hsync.integrations.accelerate: a balanced loader resumes where load_state() left "
                                 "its Balancer; iterate it as it is, with no batches skipped")
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        if not isinstance(data_loader.batch_sampler, hsync.Balancer):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.balancer is not None and self.balancer is not data_loader.batch_sampler:
            raise ValueError("hsync.integrations.accelerate: one Balancer per Accelerator (its steps drive the "
                             "optimizer's)")
        self.balancer = data_loader.batch_sampler
        self._refuse_a_second_trained_model()
        self.register_for_checkpointing(self.balancer)  # save_state / load_state carry where the data stands
        self._count_global_steps()
        place = self.device_placement if device_placement is None else device_placement
        return BalancedLoader(data_loader, self.device if place else torch.device("cpu"), self.non_blocking)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None = None, **kwargs: Any) -> None:
        """The micro-batch's weighted backward through the Balancer (Note [Accelerate]); `weight` defaults to its
        examples (pass tokens for a mean over tokens). Without a Balancer, Accelerate's own."""
        if self.balancer is None:
            super().backward(loss, **kwargs)
            return
        if kwargs:
            raise TypeError(f"hsync.integrations.accelerate: backward takes a loss and a weight, got {sorted(kwargs)}")
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        stats = self.balancer.backward(loss, weight=weight)
        step = stats is not None
        if step:
            self.step_stats = stats
            # The scale this step's losses were multiplied by: the scaler changes it only at optimizer.step().
            self.step_loss = stats.loss / (self.scaler.get_scale() if self.scaler is not None else 1.0)
            if self.scaler is None and not stats.finite:
                # A non-finite loss or gradient on any rank: every rank skips the step (fp16's scaler skips it
                # itself, and shrinks its scale).
                self.balancer.model.zero_grad(set_to_none=True)
                step = False
        self.gradient_state._set_sync_gradients(step)

    @property
    def non_blocking(self) -> bool:
        return bool(getattr(self.dataloader_config, "non_blocking", False))


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its class's constructor takes back: some record more than they take (AdamW's
    decoupled_weight_decay, which AdamW sets itself). Each group keeps them all."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}
