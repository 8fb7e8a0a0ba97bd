"""WeightedDDP: a drop-in replacement for DistributedDataParallel with instance-weighted gradients.

The hot path (gradient hooks, bucketing, scaling, all-reduce) lives in hsync._C; this file wires a
module to it and turns `backward(loss, weight)` into the engine's per-step scalars (hsync.stats). What
wrapping takes across ranks is hsync.bootstrap's; DDP's surface as hsync meets it, hsync.compat's.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel

from hsync._extension import _C
from hsync.bootstrap import engine_key
from hsync.collectives import (
    BUFFERS_BEFORE_A_FORWARD,
    BUFFERS_BEFORE_A_FORWARD_WITHOUT_GRADIENTS,
    Channels,
    make_comm,
)
from hsync.compat import (
    BUILTIN_HOOKS,
    MIB,
    Setting,
    WrapSettings,
    check_device_ids,
    check_flag,
    comm_hook_signature_refusal,
    holds_sync_batch_norm,
    hook_comm_dtype,
    ignored_names,
    in_distributed_autograd,
    is_zero_overlap_hook,
    leave_out_machinery,
    reduced_parameters,
    resolve_group,
    tensors_in,
)
from hsync.errors import describe
from hsync.join import JoinState, ShadowSteps
from hsync.stats import BAD_RANKS, LOSS_NONFINITE, StepStats, Window, bad_input_message


class WeightedDDP(DistributedDataParallel):
    """Wraps `module` for data-parallel training in which each rank may hold a different number of examples.

    `loss.backward()` gives torch DDP's result (gradients averaged over ranks with equal weights).
    `model.backward(loss, weight=n)` gives the exact gradient of the global weighted mean:
    sum_r n_r g_r / sum_r n_r, and returns the step's global StepStats.

    The positional and keyword arguments are DDP's, so code written for DDP runs unchanged; the
    methods and attributes DDP has behave as its do, except where docs/ddp-compat.md says. Beyond
    DDP's, keyword only:

    Args:
        first_bucket_cap_mb: cap of the first bucket, kept small so communication starts early (default, as
            DDP's: 1 MiB, or bucket_cap_mb where that is given).
        metric_names: names of the extra sums that backward(..., metrics={...}) may report.
        timeout: how long any one collective may take before this rank gives up with an error naming it
            (default: HSYNC_TIMEOUT seconds, else hsync.collectives.DEFAULT_TIMEOUT). It spans the skew between ranks,
            so it must exceed the longest time one rank may run ahead of another.
        comm_dtype: the dtype gradients travel in: torch.bfloat16 or torch.float16 halve the bytes on the
            wire (as DDP's bf16_compress_hook / fp16_compress_hook, with the cast fused into the
            pack). Default None: each gradient's own dtype. Gradients come back in their own dtype,
            rounded to comm_dtype; the bucket caps count bytes of comm_dtype.
        cross_rank_backward: whether the ranks' backward passes send gradients to each other (a
            SyncBatchNorm, a loss over features all-gathered with autograd). Weighted steps then scale
            each rank's loss by its weight alone, the same factor on every rank, which keeps them exact;
            otherwise each rank's gradient is expressed in a weight of its own (Note [Weighted
            reduction] in csrc/engine.h), exact only while each rank's gradient is its own. Default
            None: True if the module holds a torch.nn.SyncBatchNorm.

    DDP's arguments as hsync reads them: `process_group` or a 1-D `device_mesh` choose the group;
    `bucket_cap_mb` (default 25); `broadcast_buffers` / `forward_sync_buffers` as DDP's (rank 0's
    buffers at wrap time and before each forward that follows a synchronised one); `init_sync`
    (broadcast rank 0's state at wrap time); `gradient_as_bucket_view` (each .grad is a view into
    its bucket: no second copy of the gradients, and the next reduction rewrites .grad in place);
    `device_ids` (one device, the module's: inputs move there, as with DDP). What hsync does always
    is accepted and needs no switch: `find_unused_parameters`, `static_graph`,
    `skip_all_reduce_unused_params`, `batched_grad_copy`; `output_device` and `dim` mean nothing
    for a single-device module, as in DDP. What hsync cannot do is refused with a message:
    `delay_all_reduce_named_params`, `param_to_hook_all_reduce`, `mixed_precision`,
    `bucket_cap_mb_list`. Parameters and buffers named in `module._ddp_params_and_buffers_to_ignore`
    (DDP's `_set_params_and_buffers_to_ignore_for_model`) are neither reduced nor broadcast.

    Set HSYNC_DEBUG_COLLECTIVES=1 to compare every collective across ranks before it runs ("collective
    mismatch: ..." instead of a hang when ranks make different calls); it slows every step.

    A DistributedDataParallel by type only, so that code which recognises or unwraps a DDP by
    isinstance (checkpointers, torch.distributed.checkpoint's state_dict) sees through it too. None of
    DDP's machinery runs (its __init__ is not called: no reducer, no logger) or is there (DDP_MACHINERY);
    every method of DDP's that a training loop calls is hsync's own or works inherited.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: object = None,
        param_to_hook_all_reduce: object = None,
        mixed_precision: object = None,
        device_mesh: object = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: object = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | None = None,
        metric_names: tuple[str, ...] = (),
        timeout: datetime.timedelta | None = None,
        comm_dtype: torch.dtype | None = None,
        cross_rank_backward: bool | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not DDP's: see the class docstring
        Joinable.__init__(self)
        self._settings = WrapSettings.parse(
            module, dim=dim, broadcast_buffers=broadcast_buffers, init_sync=init_sync, bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params, bucket_cap_mb_list=bucket_cap_mb_list,
            batched_grad_copy=batched_grad_copy, forward_sync_buffers=forward_sync_buffers,
            first_bucket_cap_mb=first_bucket_cap_mb, metric_names=metric_names, timeout=timeout,
            comm_dtype=comm_dtype, cross_rank_backward=cross_rank_backward)
        group = resolve_group(process_group, device_mesh)
        if not any(p.requires_grad for p in reduced_parameters(module)):
            raise RuntimeError("hsync.WeightedDDP (like DistributedDataParallel) is not needed when a module "
                               "doesn't have any parameter that requires a gradient.")

        # The wrapper's state, apart from what is set once: its settings (self._settings, which a copy keeps);
        # what ties it to this process (self._attached: the engine, the group and what drives it beside the
        # loop; a copy has none); and the step in progress (self._window, opened by a step's first backward
        # and dropped when it synchronises; DDP's require_*_sync flags; Join's part of a forward, self._join).
        self.module = module
        self._uses_default_group = group == dist.group.WORLD
        self._hook_registered = False  # register_comm_hook was called
        self._comm_hook: tuple[object, Callable] | None = None  # a hook of the user's: Note [Communication hooks]
        self._balanced = False  # an hsync.Balancer declared its metrics: it plans for these ranks
        self._steps_begun = False  # a synchronised forward ran: too late for register_comm_hook
        self._synced_forwards = 0  # numbers the forwards whose backward synchronises (begin_backward)
        self.require_backward_grad_sync = True  # public: nanoGPT-style loops set it per micro-step
        self.require_forward_param_sync = True  # public: the last forward fed a synced step
        self._join = JoinState(self)  # hsync/join.py
        self._window: Window | None = None  # the step in progress: its micro-steps so far (None between steps)
        self._in_weighted_backward = False  # model.backward's autograd pass is running
        self._attached = _Attachments()
        self._weighted_steps_done = 0  # completed on every rank, even where backward raised: BalancedSteps
        self._steps_of_earlier_engines = 0  # synchronised steps completed by engines since replaced
        self._refreshes = 0  # refresh_trainable_parameters() calls that built new buckets: BalancedSteps
        device = next(p.device for p in reduced_parameters(module) if p.requires_grad)
        self.device_ids, self.output_device = check_device_ids(device_ids, output_device, device)
        if device.type == "cpu" and any(type(m) is nn.SyncBatchNorm for m in module.modules()):
            # DDP's refusal, at the wrap, where torch's layer would refuse its first training forward (a subclass
            # of one's own that runs on the CPU is taken).
            raise ValueError("hsync.WeightedDDP: SyncBatchNorm layers only work with GPU modules (torch's own "
                             "needs a GPU)")
        # PYTORCH_DDP_USE_SIDE_STREAM: with device_ids, inputs on another GPU are copied on a side stream.
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        # DDP's public attributes, for code that reads them (torch's _sync_module_states
        # takes broadcast_bucket_size and parameters_to_ignore from a DDP, say).
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.device_type = device.type
        self.is_multi_device_module = False  # refused otherwise, by _model_signature
        self.mixed_precision = None  # refused otherwise, by WrapSettings.parse
        self.broadcast_bucket_size = 250 * MIB
        self._build_engine(group)
        if self._settings.init_sync:
            # Every rank starts from rank 0's parameters (and buffers, unless broadcast_buffers=False).
            buffers = self._synced_buffers() if self._settings.init_buffers else []
            self._attached.engine.broadcast_coalesced([p.detach() for p in reduced_parameters(module)] + buffers, 0)

    def _build_engine(self, group: dist.ProcessGroup, refusal: Exception | None = None) -> None:
        """Checks the model across ranks and builds the engine: at wrap time, lazily for a copy, and for a
        new group. `refusal`: this rank's reason not to build it, raised on every rank after the check.
        Nothing changes unless every check passes."""
        everything = reduced_parameters(self.module, named=True)
        named = [(name, p) for name, p in everything if p.requires_grad]
        device = named[0][1].device
        settings = self._settings
        must_agree = settings.that_must_agree("the user's" if self._comm_hook else "hsync's")
        key = engine_key(group, device, self.module, must_agree, refusal, settings.timeout_s)
        self._attached.engine = _C.Engine(
            [p for _, p in named],
            [name for name, _ in named],
            make_comm(group, device, settings.timeout_s, key),
            settings.bucket_bytes_cap,
            settings.first_bucket_bytes_cap,
            settings.gradient_as_bucket_view,
            settings.comm_dtype,
        )
        if self._comm_hook is not None:  # an engine built anew (a copy, a new group) keeps the user's hook
            self._attached.engine.set_comm_hook(*self._comm_hook)
        if self._attached.param_owners is not None:
            self._attached.engine.set_owners(self._attached.param_owners, self._attached.witness)
        self._attached.frozen = [(name, p) for name, p in everything if not p.requires_grad]
        self._attached.in_buckets = {id(p) for _, p in named}
        # Weakly, like the engine: destroy_process_group() must be able to free the group (and join
        # its threads) while the model lives on; a group freed at interpreter exit aborts it.
        self._attached.group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device

    def _ensure_engine(self):
        """The engine; a copy made by pickling or deepcopy builds its own on first use (see __getstate__)."""
        if self._attached.engine is None:
            if not dist.is_initialized():
                raise RuntimeError("hsync.WeightedDDP: this copy of a wrapper (unpickled or deep-copied) "
                                   "synchronises over the default process group, so call "
                                   "torch.distributed.init_process_group() before training it, or use "
                                   "its .module alone")
            self._build_engine(dist.group.WORLD)
        return self._attached.engine

    def __getstate__(self) -> dict:
        # A copy keeps module and settings, not the communicator; it reduces over the default
        # group with an engine of its own, built when it is first trained (on every rank, as any step).
        if not self._uses_default_group:
            raise RuntimeError("hsync.WeightedDDP can be pickled or copied only when it uses the default "
                               "process group (no process_group or device_mesh argument), as with DDP; "
                               "pickle model.module instead")
        state = self.__dict__.copy()
        state.update(_attached=_Attachments(), _window=None, _join=None, require_forward_param_sync=False)
        return state

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)  # DDP's would build a reducer
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self._join = JoinState(self)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduced over (None once it was destroyed)."""
        return self._attached.group() if self._attached.group is not None else None

    @property
    def timeout(self) -> datetime.timedelta:
        """The deadline each of this wrapper's collectives runs under (the timeout argument, else HSYNC_TIMEOUT,
        else DEFAULT_TIMEOUT)."""
        return datetime.timedelta(seconds=self._settings.timeout_s)

    @property
    def parameters_to_ignore(self) -> set[str]:
        """The names of parameters and buffers neither reduced nor broadcast."""
        return ignored_names(self.module)

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before forwards (DDP's name for forward_sync_buffers)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        # Settable (a plain attribute of torch 2.11's DDP, a property since).
        check_flag("broadcast_buffers", value)
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts rank 0's buffers."""
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._synced_buffers())

    def _set_static_graph(self) -> None:
        """DDP's late form of static_graph=True, which hsync needs no more than the argument (docs/ddp-compat.md),
        with DDP's checks: set already, a warning; after training began, an error."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._steps_begun:
            raise RuntimeError("hsync.WeightedDDP: _set_static_graph() should be called before training loop starts "
                               "and after the model is wrapped (or pass static_graph=True to the wrapper)")
        self.static_graph = True

    # DDP's attributes of the same names, read from the wrapper's WrapSettings (hsync/compat.py).
    dim = Setting()
    find_unused_parameters = Setting()
    static_graph = Setting()
    gradient_as_bucket_view = Setting()
    forward_sync_buffers = Setting()
    skip_all_reduce_unused_params = Setting()
    batched_grad_copy = Setting()
    comm_dtype = Setting()
    cross_rank_backward = Setting()
    metric_names = Setting()

    def _register_buffer_comm_hook(self, *args, **kwargs) -> None:
        raise RuntimeError("hsync.WeightedDDP runs no buffer communication hooks (see docs/ddp-compat.md)")

    def _register_fused_optim(self, *args, **kwargs) -> None:
        raise RuntimeError("hsync.WeightedDDP runs no optimizer inside backward (DDP's _register_fused_optim); "
                           "call optimizer.step() after backward")

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """DDP's built-in hooks, as their Python twins: ALLREDUCE as allreduce_hook, FP16_COMPRESS as
        fp16_compress_hook (see register_comm_hook)."""
        hook = BUILTIN_HOOKS.get(comm_hook_type) if isinstance(comm_hook_type, dist.BuiltinCommHookType) else None
        self.register_comm_hook(None, hook or comm_hook_type)  # refused there, on every rank, if unknown

    def _update_process_group(self, new_process_group: dist.ProcessGroup) -> None:
        """DDP's way to shrink or grow the group without wrapping anew (as fault-tolerant trainers do after
        a failure): later steps reduce over `new_process_group`. Call it between steps, on every rank of
        the new group; it checks the model across them (a collective). As with DDP, it forgets a step
        in progress: a failed backward's, or a forward's whose backward has not run."""
        if new_process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"hsync.WeightedDDP._update_process_group: rank {dist.get_rank()} is not in the new "
                             "process group; call it on the group's ranks only")
        if not isinstance(new_process_group, dist.ProcessGroup):
            raise TypeError("hsync.WeightedDDP._update_process_group: expected a ProcessGroup, got "
                            f"{describe(new_process_group)}")
        if self._balanced:
            raise RuntimeError("hsync.WeightedDDP._update_process_group: an hsync.Balancer plans this wrapper's "
                               "steps for its ranks; wrap the model anew, with a new Balancer, for the new group")
        self._rebuild_engine(new_process_group)
        self._uses_default_group = new_process_group == dist.group.WORLD

    def _rebuild_engine(self, group: dist.ProcessGroup) -> None:
        """A new engine over `group` and the parameters that train now (a collective: every rank of the group
        calls it, between steps)."""
        previous = self._attached.engine
        self._build_engine(group)
        if previous is not None:
            previous.expect_gradients(False)  # a forward before this call no longer feeds a step
            self._steps_of_earlier_engines += previous.steps_completed()
        self._join.engine_rebuilt()

    def _trainable_parameters_outside_the_buckets(self) -> list[str]:
        """The parameters that train now but no bucket holds: unfrozen, added or replaced since the engine was
        built (a look at every parameter)."""
        return [name for name, p in reduced_parameters(self.module, named=True)
                if p.requires_grad and id(p) not in self._attached.in_buckets]

    def _retire(self) -> None:
        """Hands the module over to a new wrapper (hsync.fault_tolerance wraps it anew in each quorum): this one's
        engine stops reducing at once, even while something still holds it (a failed step's traceback does), and
        the wrapper lets go of it, its group and what drove it."""
        if self._attached.engine is not None:
            self._attached.engine.expect_gradients(False)
        self._attached = _Attachments()

    def _remove_autograd_hooks(self) -> None:
        """DDP's way to let go of the module after a backward that raised, so that a new wrapper can take it: this
        wrapper's gradient hooks stop reducing from now on (they stay registered, and do nothing)."""
        self._retire()

    def to_kwargs(self, inputs: tuple, kwargs: dict | None, device_id: int) -> tuple[tuple, tuple[dict, ...]]:
        """Inputs and kwargs moved to device `device_id` of the module's type (DDP keeps it for old code)."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device.type, device_id),
                          self.use_side_stream_for_tensor_copies)

    def _balance(self, metric_names: Sequence[str], before_sync: Callable[[], None] | None) -> BalancedSteps:
        """Puts the wrapper under an hsync.Balancer, between steps and on every rank alike: `metric_names` join
        the step's scalars, and `before_sync` runs when a weighted step's own work is done. Returns the rest
        of what the balancer drives."""
        if self._window is not None:
            raise RuntimeError("hsync.WeightedDDP: metrics can be added between steps only, not inside no_sync")
        if not self._steps_begun:
            self._find_sync_batch_norms_added_since_the_wrap()  # the Balancer splits for lockstep with one
        self._balanced = True
        added = tuple(n for n in metric_names if n not in self.metric_names)
        self._settings = self._settings.changed(metric_names=self.metric_names + added)
        self._attached.before_sync = before_sync
        return BalancedSteps(self)

    @property
    def has_comm_hook(self) -> bool:
        """Whether register_comm_hook was called (it may be, once): for a framework that registers its own."""
        return self._hook_registered

    def sync_buffers(self) -> None:
        """Makes every rank's buffers rank 0's, as the next synchronised forward would (a collective, under the
        deadline): for a framework's evaluation, which runs the module directly on each rank's own batches."""
        buffers = self._synced_buffers()
        if buffers:
            self._ensure_engine().broadcast_coalesced(buffers, 0, "the buffers (sync_buffers)")

    def refresh_trainable_parameters(self) -> bool:
        """After unfreezing parameters (requires_grad=True on some that did not train when the model was
        wrapped), or adding or replacing some: the buckets are built anew over every parameter that trains. A
        collective (one small all-reduce, and the model check when something changed): call it on every rank,
        between steps. Without it, the next synchronised forward refuses unfrozen parameters, and added ones
        train on each rank's gradient alone, as under torch's DDP (which leaves unfrozen ones so too, silently).
        Lightning's strategy calls it at each epoch's start (BackboneFinetuning unfreezes a backbone there). With
        an hsync.ShardedOptimizer the new parameters stay outside its groups (whole gradients) until its
        add_param_group takes them (which refreshes first itself). Returns whether it built new buckets; freezing
        needs no call (a frozen parameter is an unused one)."""
        outside = self._trainable_parameters_outside_the_buckets()
        keep_trainable = "leave every parameter trainable at wrap time (and out of the optimizer while frozen)"
        sharded = self._sharded_optimizer() if self._attached.param_owners is not None else None
        frozen = sharded._frozen_in_groups() if sharded is not None else None
        refusal = None if not outside else (
            f"the ShardedOptimizer steps '{frozen}', which is frozen now: new buckets would leave it out while its "
            "state stays; unfreeze it too" if frozen is not None else
            f"a ShardedOptimizer's shares were laid out without it; {keep_trainable}"
            if self._attached.param_owners is not None and sharded is None else
            f"a communication hook's state was laid out for the buckets without it; {keep_trainable}"
            if self._comm_hook is not None else
            "a step is in progress, whose micro-steps were weighed without it; unfreeze between steps"
            if self._window is not None else None)
        # Every rank decides alike: a rank alone building new buckets would meet its peers' collectives.
        flags = torch.zeros(2 * self.world_size, dtype=torch.float64)
        flags[self.rank], flags[self.world_size + self.rank] = bool(outside), refusal is not None
        flags = self._sum_waiting_for_peers(flags, "the trainable parameters' refresh").tolist()
        changed = [r for r in range(self.world_size) if flags[r] > 0]
        refused = [r for r in range(self.world_size) if flags[self.world_size + r] > 0]
        if refusal is not None:
            raise RuntimeError(f"hsync.WeightedDDP: parameter '{outside[0]}' trains now but is in no bucket "
                               f"(unfrozen, added or replaced since the model was wrapped), and {refusal}")
        if refused:
            raise RuntimeError(f"hsync.WeightedDDP.refresh_trainable_parameters: refused on rank {refused[0]}")
        if changed and len(changed) < self.world_size:
            unchanged = next(r for r in range(self.world_size) if r not in changed)
            raise RuntimeError(f"hsync.WeightedDDP.refresh_trainable_parameters: rank {changed[0]} has parameters to "
                               f"take into the buckets and rank {unchanged} has none; unfreeze, add or replace the "
                               "same on every rank")
        if not changed:
            return False
        if sharded is None:
            self._rebuild_engine(self.process_group)
        else:  # the new parameters outside its groups (whole gradients) until add_param_group takes them
            trainable = [p for p in reduced_parameters(self.module) if p.requires_grad]
            layout = sharded._layout_after_refresh(trainable)  # refuses, on every rank, a state that cannot fit
            self._attached.param_owners, self._attached.witness = None, -1  # the new engine's are given below
            self._rebuild_engine(self.process_group)
            sharded._adopt_refreshed(trainable, layout)
        self._refreshes += 1
        return True

    def _sum_waiting_for_peers(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """The sum over ranks of `tensor`, on the host, through the model's channel (its collectives keep their
        order with the engine's); the wait is the peers', not this rank's work (busy time)."""
        with self.waiting_for_peers():
            return Channels.of_model(self).all_reduce_sum(tensor, label)

    def _synced_buffers(self) -> list[torch.Tensor]:
        # Looked up each time: a buffer reassigned since wrap time is the one to send.
        ignored = ignored_names(self.module)
        return [b for name, b in self.module.named_buffers() if name not in ignored and b.numel() > 0]

    def forward(self, *inputs, **kwargs):
        inputs, kwargs, synced = self._prepare_forward(*inputs, **kwargs)
        with self._splitting_compiled_graphs():
            output = self.module(*inputs, **kwargs)
        return self._finish_forward(output, synced)

    # Under torch.compile(wrapper) dynamo compiles the module's forward and leaves this bookkeeping to
    # Python: traced, its step-to-step values (a float timing the buffer broadcast, say) would be
    # guarded on, and every step would compile the rest of forward anew. Disabled, not merely kept
    # in a function of its own, so that this holds whatever dynamo does at a nested graph break.
    # (Not DDP's _pre_forward / _post_forward: different signatures under the same names would break
    # torch code that calls DDP's.)
    @torch._disable_dynamo
    def _prepare_forward(self, *inputs, **kwargs) -> tuple[tuple, dict, bool]:
        """The inputs on the module's device, and whether the next backward synchronises, after this
        forward's share of the step: the engine told, joined ranks answered, rank 0's buffers received."""
        self._refuse_an_outer_ddp()
        # Only a forward with gradients outside no_sync makes the next backward synchronise
        # (Note [Which backward synchronises] in csrc/engine.h).
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synced and not self._steps_begun:
            self._find_sync_batch_norms_added_since_the_wrap()
        config = self._join_config
        if config.enable and not config.throw_on_early_termination and self.cross_rank_backward:
            # Refused before any collective, on every rank alike: under Join every rank runs forwards. With
            # throw_on_early_termination no rank shadows: all stop at the first forward after one ran out.
            raise RuntimeError("hsync.WeightedDDP under Join: a joined rank cannot shadow forwards and backwards "
                               "that are collectives themselves (cross_rank_backward, a SyncBatchNorm); use "
                               "join(throw_on_early_termination=True), which stops every rank when one runs out")
        if self.device_ids and (inputs or kwargs):
            # torch's own move (a PackedSequence keeps its batch sizes on the host).
            moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs, self.device, self.use_side_stream_for_tensor_copies)
            inputs, kwargs = moved_inputs[0], moved_kwargs[0]
        if self._attached.engine is None and not synced and not self._join_config.enable:
            return inputs, kwargs, False  # a copy not trained yet: nothing to synchronise
        engine = self._ensure_engine()
        if synced:
            if in_distributed_autograd():  # before any collective: every rank trains alike
                raise RuntimeError("hsync.WeightedDDP: a forward inside torch's distributed autograd context "
                                   "(dist_autograd.context()); dist_autograd.backward leaves gradients in the "
                                   "context, where hsync does not reduce them: train a model that takes part in RPC "
                                   "with torch's DDP")
            self._refuse_parameters_unfrozen_since_the_engine_was_built()
            self._refuse_a_sharded_optimizer_dropped()
            engine.expect_gradients(True)
            self._steps_begun = True
            self._synced_forwards += 1
        buffers_due = self.require_forward_param_sync and self.forward_sync_buffers
        root = self._join.before_forward(synced, buffers_due)
        if buffers_due:
            buffers = self._synced_buffers()
            if buffers:
                engine.broadcast_coalesced(buffers, root, BUFFERS_BEFORE_A_FORWARD if synced else
                                           BUFFERS_BEFORE_A_FORWARD_WITHOUT_GRADIENTS)
        self.require_forward_param_sync = synced
        return inputs, kwargs, synced

    def _find_sync_batch_norms_added_since_the_wrap(self) -> None:
        """torch's convert_sync_batchnorm run on the model after the wrap (DDP's documentation asks before) makes
        backward a collective, with the same parameters: weighted steps would stay inexact, silently, unless each
        rank's loss is scaled by its weight alone (cross_rank_backward). Looked for where it was found at the wrap
        (not given), once: before the first synchronised step and when a Balancer takes the model."""
        if (self._settings.cross_rank_backward_found and not self.cross_rank_backward
                and holds_sync_batch_norm(self.module)):
            self._settings = self._settings.changed(cross_rank_backward=True)

    def _refuse_a_sharded_optimizer_dropped(self) -> None:
        """An hsync.ShardedOptimizer has each gradient reduced to its parameter's owner only (the model holds it
        weakly). Once it is gone, another optimizer would step each rank's parameters with the gradients of its
        own shard, and the ranks' models would drift apart, silently: refused before any collective, on every
        rank alike (the program drops it at the same point on each)."""
        if self._attached.param_owners is not None and self._sharded_optimizer() is None:
            raise RuntimeError("hsync.WeightedDDP: the hsync.ShardedOptimizer that shards this model's gradients (each "
                               "reduced to the rank that owns its parameter) is gone: no reference to it was kept. "
                               "Keep it for as long as the model trains; to step the model with another optimizer, "
                               "make that one an hsync.ShardedOptimizer too")

    def _refuse_parameters_unfrozen_since_the_engine_was_built(self) -> None:
        """A parameter frozen at wrap time that requires a gradient now would train on its rank's gradient alone,
        and the ranks' models would drift apart (torch's DDP lets them, silently): refused before any collective,
        on every rank that unfroze it. (A rank cannot build a new engine here alone: its peers might not have
        unfrozen it, and would meet the new engine's collectives with their step's.)"""
        unfrozen = [name for name, p in self._attached.frozen if p.requires_grad]  # none in most models
        if unfrozen:
            more = f" and {len(unfrozen) - 1} more" if len(unfrozen) > 1 else ""
            raise RuntimeError(
                f"hsync.WeightedDDP: parameter '{unfrozen[0]}'{more} did not require a gradient when the model "
                "was wrapped and does now, so its gradient would not be averaged over the ranks; after unfreezing, "
                "call model.refresh_trainable_parameters() on every rank, between steps")

    def _refuse_an_outer_ddp(self) -> None:
        """A torch DDP around this wrapper (what Trainer, Accelerate's prepare and Lightning do to any model)
        would reduce the same gradients again, unweighted, and hsync would change nothing: refused at the
        first forward, on every rank alike, before any gradient is reduced."""
        outer = DistributedDataParallel._active_ddp_module  # the DDP whose forward is running, if any
        if outer is None or isinstance(outer, WeightedDDP) or not any(m is self for m in outer.module.modules()):
            return
        raise RuntimeError(
            "hsync.WeightedDDP is wrapped in a torch DistributedDataParallel, which would reduce its gradients "
            "again with equal weights; give the framework the WeightedDDP unwrapped (transformers.Trainer: "
            "hsync.integrations.transformers.Trainer; Accelerate: hsync.integrations.accelerate.Accelerator; your "
            "own loop: no DistributedDataParallel around it)")

    @torch._disable_dynamo
    def _finish_forward(self, output, synced: bool):
        if synced:
            _on_backward_start(output, self._begin_synced_backward, self._synced_forwards)
        return output

    def _begin_synced_backward(self, forward: int) -> None:
        """When backward reaches the output of a synchronised forward (on the autograd thread). A plain
        loss.backward() there, after weighted micro-steps under no_sync, would end their window unweighted, and the
        next weighted step would count its weights: refused, before any of its collectives."""
        if not self._in_weighted_backward and self._holds_a_partial_step():
            raise RuntimeError("hsync.WeightedDDP: this step's earlier micro-batches were weighted "
                               "(model.backward(loss, weight=n) under no_sync), and a plain loss.backward() would "
                               "end it unweighted; end it with model.backward(loss, weight=n) too, or drop its "
                               "gradients first (optimizer.zero_grad())")
        self._attached.engine.begin_backward(forward)

    def _holds_a_partial_step(self) -> bool:
        """Whether weighted micro-steps under no_sync wait for their synchronised backward (a window whose
        gradients were not dropped since)."""
        return self._window is not None and not self._window_gradients_dropped()

    def _window_gradients_dropped(self) -> bool:
        """Whether the open window's gradients were dropped (optimizer.zero_grad() to abandon a step mid-accumulation,
        as with DDP): the window is then forgotten with them, or its weights would count in the next step's mean.
        Told by one gradient the window left: gone (set to None), or changed since and all zeros (the host waits for
        the device there, in that rare case only)."""
        witness = self._window.witness if self._window is not None else None
        if witness is None or witness[0]() is None:
            return False
        param, grad, version = witness
        now = param().grad
        dropped = now is None or ((now is not grad() or now._version != version) and not bool(now.any()))
        if dropped:
            self._window = None
        return dropped

    def _witness_gradient(self) -> tuple[weakref.ref, weakref.ref, int] | None:
        """A parameter with a gradient, the gradient and its version, held weakly: a window keeps no memory alive,
        and its copies (window_backup's) copy no tensor (see _window_gradients_dropped)."""
        return next(((weakref.ref(p), weakref.ref(p.grad), p.grad._version) for p in self.module.parameters()
                     if p.grad is not None), None)

    @property
    def bucket_bytes_cap(self) -> int:
        """The size in bytes at which torch.compile splits the module's graphs, so that each
        piece's gradients reach their buckets while backward goes on (`bucket_cap_mb`, but at least
        the first-bucket cap of dynamo's DDPOptimizer, which refuses anything smaller)."""
        return max(self._settings.bucket_bytes_cap, dist._DEFAULT_FIRST_BUCKET_BYTES)

    @contextlib.contextmanager
    @torch._disable_dynamo(recursive=False)
    def _splitting_compiled_graphs(self) -> Iterator[None]:
        # A compiled graph's backward is one autograd node: every gradient in it arrives when it
        # ends, too late to overlap the all-reduces with backward. While DDP runs its module's
        # forward, dynamo splits each graph it compiles there at bucket_bytes_cap boundaries
        # (DDPOptimizer); it asks DDP's class which module is running, as torch's own `replicate`
        # answers for itself. Saved and restored for nested wrappers.
        previous = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = self
        try:
            yield
        finally:
            DistributedDataParallel._active_ddp_module = previous

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """DDP's: `hook(state, bucket)` gets each bucket as a torch.distributed.GradBucket and returns a
        torch.futures.Future of its buffer reduced, which is written back into the gradients (PowerSGD,
        a compression of your own, torch's hooks and their wrappers). A weighted step hands it every
        gradient scaled by world_size * n_r / N, so a hook that sums and divides by the world size, as
        DDP's do, yields the weighted mean (Note [Communication hooks] in csrc/engine.cpp).

        torch's hooks whose arithmetic hsync's pack does itself take the fast path instead:
        `bf16_compress_hook` and `fp16_compress_hook`, or `bf16_compress_wrapper` / `fp16_compress_wrapper`
        around `allreduce_hook`, set `comm_dtype` (the cast rides in the pack); `allreduce_hook` alone, the
        full-precision mean, sets comm_dtype=None.

        As with DDP, call it once, on every rank, before the first backward."""
        known, comm_dtype = hook_comm_dtype(hook)
        refusal = self._comm_hook_refusal(state, hook, known)
        previous = self._settings, self._comm_hook
        if refusal is None and known:
            self._settings = self._settings.changed(comm_dtype=comm_dtype)
        elif refusal is None:
            self._comm_hook = (state, hook)
        try:
            # A collective on every rank, refused or not: a rank's refusal is then raised on every rank, and
            # so is a hook of the user's on some ranks only (their buckets would travel differently).
            self._build_engine(self.process_group or dist.group.WORLD, refusal)
        except BaseException:
            self._settings, self._comm_hook = previous
            raise
        self._hook_registered = True

    def _comm_hook_refusal(self, state: object, hook: Callable, known: bool) -> Exception | None:
        refusal = comm_hook_signature_refusal(hook)
        if refusal is not None:
            return refusal
        if is_zero_overlap_hook(hook):
            return RuntimeError("hsync.WeightedDDP.register_comm_hook: torch's hook_with_zero_step overlaps a "
                                "ZeroRedundancyOptimizer with DDP's own reducer, which hsync replaces; "
                                "hsync.ShardedOptimizer(model, optimizer_class, ...) is hsync's sharded optimizer "
                                "(each bucket reduced to the rank that steps it), with no hook to register")
        if known and state is not None and state is not self.process_group:
            return ValueError("hsync.WeightedDDP.register_comm_hook: the state of torch's allreduce and compress "
                              "hooks must be None or the wrapper's own process group")
        if self._hook_registered:
            return RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._attached.param_owners is not None and not known:
            return RuntimeError("hsync.WeightedDDP.register_comm_hook: an hsync.ShardedOptimizer reduces each "
                                "bucket to the rank that owns its parameters, and a communication hook hands every "
                                "bucket to every rank; register the hook without sharding the optimizer")
        if self._steps_begun:
            return RuntimeError("register_comm_hook must be called before the first backward, as with DDP")
        return None

    def _set_param_owners(self, owners: list[int], optimizer: Joinable, witness: int = -1) -> None:
        """Each trainable parameter's owner, in registration order: its gradient is reduced to that rank only
        (Note [Owned buckets] in csrc/engine.cpp), and the `witness` of a non-finite step on a rank that owns
        none (Note [A non-finite step on every rank]). The ShardedOptimizer's (`optimizer`); every rank, between
        steps."""
        if self._comm_hook is not None:
            raise RuntimeError("hsync.ShardedOptimizer: this model has a communication hook of the user's, which "
                               "hands every bucket to every rank; sharding reduces each bucket to its owner")
        self._ensure_engine().set_owners(owners, witness)
        self._attached.param_owners = list(owners)
        self._attached.witness = witness
        self._attached.sharded_optimizer = weakref.ref(optimizer)

    def _sharded_optimizer(self) -> Joinable | None:
        return self._attached.sharded_optimizer() if self._attached.sharded_optimizer is not None else None

    @contextlib.contextmanager
    def waiting_for_peers(self) -> Iterator[None]:
        """Brackets a collective of the training loop's own (a metric's all-reduce, a framework's broadcast) as a
        wait for peers: StepStats.busy_seconds, which an hsync.Balancer plans from, leaves it out as it leaves
        out hsync's own waits. Unbracketed, a fast rank's wait there for a slow one counts as its work, and
        both look equally slow (Note [Busy time] in csrc/busy_clock.h)."""
        engine = self._ensure_engine()
        engine.begin_peer_wait()
        try:
            yield
        finally:
            engine.end_peer_wait()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards inside it are not followed by a reduction.

        The next synchronised step reduces everything accumulated."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """DDP's context for uneven inputs: a rank that ran out of batches shadows the others' steps.

        A joined rank contributes weight 0, so weighted steps stay exact. Plain `loss.backward()` steps
        divide by the world size (divide_by_initial_world_size=True, DDP's default) or by the number of
        ranks not joined yet. At the end every rank holds the parameters of the last rank to join.
        As with DDP, each forward under join must be followed by at most one synchronised backward."""
        optimizer = self._sharded_optimizer()  # its steps are shadowed too: Note [Sharded steps under Join]
        return Join([self] + ([optimizer] if optimizer is not None else []), enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return ShadowSteps(self._join, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        return self._join.process_group()  # Join's collectives under hsync's deadline: hsync/join.py

    def backward(
        self,
        loss: torch.Tensor,
        weight: float | torch.Tensor,
        metrics: Mapping[str, float | torch.Tensor] | None = None,
    ) -> StepStats | None:
        """Backpropagates the local mean `loss` over `weight` examples (or tokens).

        Synchronised: gradients become sum_r n_r g_r / sum_r n_r over every rank and micro-step of
        the window, and the step's StepStats is returned. Under no_sync: accumulates and returns None.
        A bad input on any rank raises ValueError on every rank at the synchronised step.
        """
        engine = self._ensure_engine()
        if self.cross_rank_backward and not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            # Refused here, before any collective of this rank's: hsync's would meet the collectives of
            # its peers' backward passes (SyncBatchNorm's), which this rank cannot run.
            raise ValueError(f"hsync: rank {self.rank}'s loss ({describe(loss)}) does not require a gradient "
                             "(computed under no_grad, or detached?), but with cross_rank_backward every rank's "
                             "backward takes part in collectives that its peers are waiting in: this rank cannot "
                             "go on, and its peers fail when it exits or at their process group's timeout")
        self._join.check_backward()
        self._window_gradients_dropped()
        window = self._window or self._open_window()
        self._window = window
        w = window.add(loss, weight, metrics or {}, self.metric_names)
        if not self.require_backward_grad_sync:
            engine.expect_gradients(False)  # accumulate, even after a forward outside no_sync
            # The window's next forward belongs to this step, whose buffers came with its first: one
            # broadcast per step, however many micro-batches each rank runs.
            self.require_forward_param_sync = False
            try:
                self._backprop_micro_step(loss, w, window.ref)
            except BaseException as error:
                # Note [A backward that fails] in csrc/engine.h
                if self.cross_rank_backward:
                    engine.abandon_step(_backward_failure(error))
                window.local[LOSS_NONFINITE] += 1
                raise
            window.witness = self._witness_gradient() or window.witness
            return None

        self._window = None
        scalars = window.scalars(self.rank)

        engine.begin_weighted_step(scalars, window.ref)
        try:
            self._backprop_micro_step(loss, w, window.ref)
        except BaseException as error:
            # Note [A backward that fails] in csrc/engine.h
            if self.cross_rank_backward:
                engine.abandon_step(_backward_failure(error))
                raise
            engine.mark_step_failed()
            try:
                self._complete_step(engine)  # its peers are waiting in the step's collectives
            except BaseException as failure:
                if str(failure) == str(error):  # the communicator's one failure, which backward met first
                    raise error from None
                raise
            raise
        busy = self._complete_step(engine)
        engine.start_busy_interval()  # the next step's own work starts where this step ends
        # The next forward starts a step, whose buffers come with it, also after a window whose forwards
        # all ran under no_sync (a backward of a constant loss synchronised it): its peers broadcast them.
        self.require_forward_param_sync = True
        host = engine.step_scalars()
        if host[BAD_RANKS] > 0:
            self._drop_gradients()  # a partial sum, with the window's earlier micro-batches in it
            raise ValueError(bad_input_message(host, window.problem, self.rank))
        return self._step_stats(host, None if busy is None else busy.seconds)

    def _drop_gradients(self) -> None:
        """Sets every parameter's .grad to None: after a step whose reduced gradients must not be used."""
        for p in self.module.parameters():
            p.grad = None

    def _complete_step(self, engine) -> _C.BusyInterval | None:
        """Runs the weighted step's remaining collectives; returns this rank's own work since the last
        step ended, without its waits for peers (none after a step that failed): Note [Busy time] in
        csrc/busy_clock.h."""
        if self._attached.before_sync is not None:
            self._attached.before_sync()
        busy = engine.end_busy_interval()
        engine.finalize_if_pending()
        self._weighted_steps_done += 1
        return busy

    def _open_window(self) -> Window:
        return Window.open(self.device, len(self.metric_names), common_unit=self.cross_rank_backward)

    def _step_stats(self, host: torch.Tensor, busy: Callable[[], float] | None) -> StepStats:
        """The StepStats of the step whose reduced scalars are `host`."""
        engine = self._attached.engine
        return StepStats(host, engine.last_grad_nonfinite(), self.metric_names, engine.check, busy)

    def _backprop_micro_step(self, loss, weight: torch.Tensor | None, ref: torch.Tensor) -> None:
        """Backpropagates the micro-step's loss, scaled to `ref`'s units; `weight` None: its input was bad."""
        self._in_weighted_backward = True
        try:
            self._backprop_scaled(loss, weight, ref)
        finally:
            self._in_weighted_backward = False

    def _backprop_scaled(self, loss, weight: torch.Tensor | None, ref: torch.Tensor) -> None:
        if weight is not None and loss.requires_grad:
            # Gradients are accumulated in units of `ref` (Note [Weighted reduction] in csrc/engine.h):
            # the first micro-step backpropagates the loss unscaled, later ones by weight / ref.
            scale = torch.where(ref > 0, weight / ref.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
            (loss * scale.to(loss.dtype)).backward()
        elif self.cross_rank_backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
            # A bad input still takes its part in backward's collectives, which its peers are waiting
            # in; the step is then refused on every rank.
            (loss.sum() * 0).backward()

    @property
    def bucket_params(self) -> list[list[int]]:
        """Each bucket's parameters (indices into the parameters that require grad), in launch order."""
        return self._ensure_engine().bucket_params()


leave_out_machinery(WeightedDDP)


@dataclass
class _Attachments:
    """What ties a wrapper to this process: its engine and group, and what drives it beside the training loop
    (a ShardedOptimizer, a Balancer). A copy (pickle, deepcopy) has none: it builds an engine over the default
    group when first trained."""

    engine: _C.Engine | None = None
    group: weakref.ref | None = None  # weakly, like the engine: see WeightedDDP._build_engine
    param_owners: list[int] | None = None  # a ShardedOptimizer's: Note [Owned buckets] in csrc/engine.cpp
    witness: int = -1  # its witness of a non-finite step: Note [A non-finite step on every rank], ditto
    sharded_optimizer: weakref.ref | None = None  # that ShardedOptimizer, weakly
    before_sync: Callable[[], None] | None = None  # a Balancer's: runs when a weighted step's own work is done
    # The parameters that did not require a gradient when the engine was built: no bucket holds them.
    frozen: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    in_buckets: set[int] = field(default_factory=set)  # the ids of the parameters the engine reduces


class BalancedSteps:
    """What hsync.Balancer drives in a WeightedDDP beyond its public API (WeightedDDP._balance): the one seam
    between the two."""

    def __init__(self, model: WeightedDDP) -> None:
        self._model = model

    @property
    def completed(self) -> int:
        """Weighted steps completed on every rank, those whose backward raised here included."""
        return self._model._weighted_steps_done

    @property
    def synchronised(self) -> int:
        """Synchronised steps completed, plain and weighted: those of the balancer's and any of the loop's own."""
        model = self._model
        engine = model._attached.engine
        return model._steps_of_earlier_engines + (engine.steps_completed() if engine is not None else 0)

    @property
    def refreshes(self) -> int:
        """How often the trainable parameters changed (refresh_trainable_parameters): the memory a micro-batch
        takes may have changed with them."""
        return self._model._refreshes

    @property
    def last_refused(self) -> bool:
        """Whether the last completed weighted step was refused for a rank's bad input (known on every rank alike)."""
        return bool(self._model._ensure_engine().step_scalars()[BAD_RANKS] > 0)

    def last_stats(self) -> StepStats:
        """The last completed weighted step's StepStats (without busy_seconds), for a backward that raised after
        the step's collectives ran: the balancer then counts the step as its peers do."""
        model = self._model
        return model._step_stats(model._ensure_engine().step_scalars(), None)

    def busy_seconds_so_far(self) -> float | None:
        """This rank's own work since its last weighted step ended, less its waits for peers; None before the
        first (Note [Busy time] in csrc/busy_clock.h). On a GPU reading it waits for the device."""
        return self._model._ensure_engine().busy_seconds_so_far()

    def window_backup(self) -> Callable[[], None]:
        """Restores the accumulation window as it is now: what a micro-step that failed added to it (its weight,
        its loss, the failure's non-finite mark) undone, for a micro-batch that runs again in parts."""
        saved = copy.deepcopy(self._model._window)

        def restore() -> None:
            self._model._window = saved

        return restore


def _on_backward_start(output, callback: Callable[[int], None], forward: int) -> None:
    """Calls `callback(forward)` when backward reaches an output tensor (csrc/engine.cpp's Notes
    [Nested backwards] and [A second backward through one forward])."""
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors_in(output) if t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(lambda grad_outputs: callback(forward))


def _backward_failure(error: BaseException) -> str:
    return (f"backward raised {type(error).__name__}: {error}. With cross_rank_backward its peers may be waiting "
            "in collectives of the backward pass, so the step cannot complete; rebuild the wrapper (or restart) "
            "to go on")


