"""WeightedDDP: a drop-in replacement for DistributedDataParallel with instance-weighted gradients.

The hot path (gradient hooks, bucketing, scaling, all-reduce) lives in hsync._C; this file
wires a module to it and turns `backward(loss, weight)` into the engine's per-step scalars.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import datetime
import inspect
import math
import numbers
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel

from hsync._extension import _C
from hsync.stats import (
    BAD_KIND_SUM,
    BAD_RANK_SUM,
    BAD_RANKS,
    LOSS_NONFINITE,
    LOSS_SUM,
    NUM_SLOTS,
    WEIGHT,
    BadInput,
    StepStats,
)

_MIB = 1024 * 1024
_COMM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# torch's hooks whose arithmetic hsync's pack does itself, as the comm_dtype each means: the mean's
# all-reduce in the gradients' own dtype (DDP's default, written as a hook), and that all-reduce in
# half precision, by a hook or by a wrapper around allreduce_hook. A wrapper returns a closure over
# the hook it wraps: known by its code, and by allreduce_hook in its one cell.
_HOOK_COMM_DTYPES = {default_hooks.allreduce_hook: None, default_hooks.bf16_compress_hook: torch.bfloat16,
                     default_hooks.fp16_compress_hook: torch.float16}
_WRAPPER_CODE_COMM_DTYPES = {default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook).__code__: torch.bfloat16,
                             default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook).__code__: torch.float16}
_BUILTIN_HOOKS = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                  dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
# torch releases after 2.11 deprecate broadcast_buffers in favour of forward_sync_buffers, and warn.
DDP_DEPRECATES_BROADCAST_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters

# DDP's reducer, logger, and forward and buffer plumbing, which hsync replaces. Inherited, each would fail
# reaching for state a WeightedDDP does not have; absent, `hasattr` tells the truth and a call names the
# attribute. Every other name of DDP's class is hsync's own or inherited on purpose: see
# test_every_attribute_of_ddps_class_is_hsyncs_own_inherited_on_purpose_or_absent.
_DDP_MACHINERY = (
    "_assign_modules_buffers", "_build_debug_param_to_name_mapping", "_build_params_for_reducer",
    "_check_and_sync_module_buffers", "_check_comm_hook", "_check_default_group",
    "_check_global_requires_backward_grad_sync", "_check_reducer_finalized", "_check_sync_bufs_post_fwd",
    "_check_sync_bufs_pre_fwd", "_clear_grad_buffer", "_ddp_init_helper", "_default_broadcast_coalesced",
    "_delayed_all_reduce_hook", "_distributed_broadcast_coalesced", "_find_common_rank",
    "_fire_reducer_autograd_hook", "_get_ddp_logging_data", "_lazy_init", "_log_and_throw",
    "_match_all_reduce_for_bwd_pass", "_match_unused_params_allreduce", "_module_wait_for_copy_hook",
    "_passing_sync_batchnorm_handle", "_post_forward", "_pre_forward", "_register_accum_grad_hook",
    "_register_delay_all_reduce_hook", "_remove_autograd_hooks", "_root_copy_hook", "_run_ddp_forward",
    "_set_ddp_runtime_logging_sample_rate", "_set_sparse_metadata", "_setup_in_backward_optimizers",
    "_sync_buffers", "_sync_module_buffers",
)
_FLAGS_WITH_DEFAULT_NONE = ("broadcast_buffers", "forward_sync_buffers", "cross_rank_backward")
_MAX_TIMEOUT = datetime.timedelta(days=365)  # the engine's clocks count nanoseconds in 64 bits
# Per group, the index of the next engine built over it: with the group's name, names an engine's store
# keys. The ranks agree on it as they build one (the largest any proposes), so a rank outside a group,
# which skips that group's engines, or a process that replaced a failed one, uses the same keys.
_engines_built: collections.defaultdict[str, int] = collections.defaultdict(int)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""Collective deadline unless WeightedDDP(timeout=...) or HSYNC_TIMEOUT (seconds) says otherwise: longer
than any sane step or checkpoint write, half of torch's NCCL default, and a dead peer is usually seen
far sooner (its sockets close, or a peer posts the failure)."""


@dataclass
class _Window:
    """What the micro-steps of one accumulation window (no_sync ... synced step) add up to."""

    local: torch.Tensor
    """This rank's step scalars, slot layout of hsync.stats (float64 on the model's device)."""
    ref: torch.Tensor
    """The weight local gradients are expressed in: the window's first non-zero weight, or 1 on every
    rank with cross_rank_backward."""
    out_of_range: torch.Tensor
    """How many weights of the window were negative, NaN or infinite (checked on the device)."""
    problem: str | None = None
    """This rank's first bad input found on the host, raised on every rank at the synced step."""
    problem_kind: BadInput | None = None


class WeightedDDP(DistributedDataParallel):
    """Wraps `module` for data-parallel training in which each rank may hold a different number of examples.

    `loss.backward()` gives torch DDP's result (gradients averaged over ranks with equal weights).
    `model.backward(loss, weight=n)` gives the exact gradient of the global weighted mean:
    sum_r n_r g_r / sum_r n_r, and returns the step's global StepStats.

    The positional and keyword arguments are DDP's, so code written for DDP runs unchanged; the
    README lists where behaviour differs. Beyond DDP's, keyword only:

    Args:
        first_bucket_cap_mb: cap of the first bucket, kept small so communication starts early.
        metric_names: names of the extra sums that backward(..., metrics={...}) may report.
        timeout: how long any one collective may take before this rank gives up with an error naming it
            (default: HSYNC_TIMEOUT seconds, else DEFAULT_TIMEOUT). It spans the skew between ranks,
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
    DDP's machinery runs (its __init__ is not called: no reducer, no logger) or is there (_DDP_MACHINERY);
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
        first_bucket_cap_mb: float = _C.default_first_bucket_bytes_cap / _MIB,
        metric_names: tuple[str, ...] = (),
        timeout: datetime.timedelta | None = None,
        comm_dtype: torch.dtype | None = None,
        cross_rank_backward: bool | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not DDP's: see the class docstring
        Joinable.__init__(self)
        flags = dict(init_sync=init_sync, find_unused_parameters=find_unused_parameters,
                     check_reduction=check_reduction, gradient_as_bucket_view=gradient_as_bucket_view,
                     static_graph=static_graph, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                     batched_grad_copy=batched_grad_copy, broadcast_buffers=broadcast_buffers,
                     forward_sync_buffers=forward_sync_buffers, cross_rank_backward=cross_rank_backward)
        for name, value in flags.items():
            if not isinstance(value, bool) and not (value is None and name in _FLAGS_WITH_DEFAULT_NONE):
                raise TypeError(f"hsync.WeightedDDP: {name} must be True or False, got {_describe(value)}")
        unsupported = dict(delay_all_reduce_named_params=delay_all_reduce_named_params,
                           param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                           bucket_cap_mb_list=bucket_cap_mb_list)
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"hsync.WeightedDDP does not support DDP's {name}; leave it unset "
                                 "(see 'Differences from DDP' in the README)")
        if check_reduction:
            warnings.warn("The `check_reduction` argument is deprecated (as in DDP) and has no effect.",
                          FutureWarning, stacklevel=2)
        if broadcast_buffers is not None and DDP_DEPRECATES_BROADCAST_BUFFERS:
            warnings.warn("`broadcast_buffers` is deprecated (as in this torch's DDP) and ignored when "
                          "`forward_sync_buffers` is given" if forward_sync_buffers is not None else
                          "`broadcast_buffers` is deprecated (as in this torch's DDP); use `forward_sync_buffers`, "
                          "which, unlike `broadcast_buffers=False`, still broadcasts rank 0's buffers at wrap time",
                          FutureWarning, stacklevel=2)
        if not isinstance(dim, int):
            raise TypeError(f"hsync.WeightedDDP: dim must be an int, got {_describe(dim)}")
        if not dist.is_initialized():
            raise RuntimeError("hsync.WeightedDDP needs torch.distributed.init_process_group() first")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            process_group = device_mesh.get_group(mesh_dim=0)
        bucket_cap_mb = _C.default_bucket_bytes_cap / _MIB if bucket_cap_mb is None else bucket_cap_mb
        if not (bucket_cap_mb > 0 and first_bucket_cap_mb > 0):
            raise ValueError(f"bucket caps must be positive, got {bucket_cap_mb} and {first_bucket_cap_mb} MiB")
        if comm_dtype is not None and comm_dtype not in _COMM_DTYPES:
            raise (ValueError if isinstance(comm_dtype, torch.dtype) else TypeError)(
                f"hsync.WeightedDDP: comm_dtype must be None or one of "
                f"{', '.join(map(str, _COMM_DTYPES))}, got {_describe(comm_dtype)}")
        if not any(p.requires_grad for p in _reduced_parameters(module)):
            raise RuntimeError("hsync.WeightedDDP (like DistributedDataParallel) is not needed when a module "
                               "doesn't have any parameter that requires a gradient.")

        self.module = module
        self.dim = dim
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # As DDP's: broadcast_buffers=False also skips the buffers at wrap time, forward_sync_buffers does not.
        self.forward_sync_buffers = forward_sync_buffers if forward_sync_buffers is not None else (
            broadcast_buffers is not False)
        self.metric_names = tuple(metric_names)
        self._bucket_bytes_cap = int(bucket_cap_mb * _MIB)
        self._first_bucket_bytes_cap = int(first_bucket_cap_mb * _MIB)
        self._timeout_s = _resolve_timeout(timeout)
        self.comm_dtype = comm_dtype
        self._cross_rank_backward = cross_rank_backward if cross_rank_backward is not None else any(
            isinstance(m, nn.SyncBatchNorm) for m in module.modules())
        self._uses_default_group = process_group is None or process_group == dist.group.WORLD
        self._hook_registered = False  # register_comm_hook was called
        self._balanced = False  # an hsync.Balancer declared its metrics: it plans for these ranks
        self._steps_begun = False  # a synchronised forward ran: too late for register_comm_hook
        self.require_backward_grad_sync = True  # public, as DDP's: nanoGPT-style loops set it per micro-step
        self.require_forward_param_sync = True  # public, as DDP's: the last forward fed a synced step
        self._join_announced = False  # what this rank's last forward under Join told the joined ranks
        self._plain_steps_join: bool | None = None  # the engine's plain steps under Join: their divide flag
        self._divide_by_initial_world_size = True
        self._window: _Window | None = None
        self._engine = None
        self._before_sync: Callable[[], None] | None = None  # runs when a weighted step's local work is done
        self._weighted_steps_done = 0  # completed on every rank, even where backward raised: _last_step_stats
        device = next(p.device for p in _reduced_parameters(module) if p.requires_grad)
        self.device_ids, self.output_device = _check_device_ids(device_ids, output_device, device)
        # As DDP's (PYTORCH_DDP_USE_SIDE_STREAM): with device_ids, inputs on another GPU are copied on a side stream.
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        # DDP's public attributes, as DDP sets them, for code that reads them (torch's _sync_module_states
        # takes broadcast_bucket_size and parameters_to_ignore from a DDP, say).
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.device_type = device.type
        self.is_multi_device_module = False  # refused otherwise, by _model_signature
        self.mixed_precision = None  # refused otherwise, above
        self.broadcast_bucket_size = 250 * _MIB
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params  # accepted; changes nothing
        self.batched_grad_copy = batched_grad_copy  # accepted; changes nothing
        self._build_engine(process_group or dist.group.WORLD)
        if init_sync:
            # Like DDP: every rank starts from rank 0's parameters (and buffers, unless broadcast_buffers=False).
            init_buffers = forward_sync_buffers is not None or broadcast_buffers is not False
            buffers = self._synced_buffers() if init_buffers else []
            self._engine.broadcast_coalesced([p.detach() for p in _reduced_parameters(module)] + buffers, 0)

    def _build_engine(self, group: dist.ProcessGroup, refusal: Exception | None = None) -> None:
        """Checks the model across ranks and builds the engine: at wrap time, lazily for a copy, and for a
        new group. `refusal`: this rank's reason not to build it, raised on every rank after the check.
        Nothing changes unless every check passes."""
        named = [(name, p) for name, p in _reduced_parameters(self.module, named=True) if p.requires_grad]
        group_name = dist.distributed_c10d._get_process_group_name(group)
        device = named[0][1].device
        index = _verify_same_model(group, device, self.module, self._settings_that_must_agree(), refusal,
                                   _engines_built[group_name])
        _engines_built[group_name] = index + 1
        self._engine = _C.Engine(
            [p for _, p in named],
            [name for name, _ in named],
            _make_comm(group, device, self._timeout_s, f"{group_name}/{index}"),
            self._bucket_bytes_cap,
            self._first_bucket_bytes_cap,
            self.gradient_as_bucket_view,
            self.comm_dtype,
        )
        # Weakly, like the engine: destroy_process_group() must be able to free the group (and join
        # its threads) while the model lives on; a group freed at interpreter exit aborts it.
        self._group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device

    def _settings_that_must_agree(self) -> dict[str, object]:
        """What shapes the collectives: ranks that disagree would send buckets that don't match."""
        return dict(comm_dtype=self.comm_dtype, bucket_cap_mb=self._bucket_bytes_cap / _MIB,
                    first_bucket_cap_mb=self._first_bucket_bytes_cap / _MIB,
                    cross_rank_backward=self.cross_rank_backward)

    def _ensure_engine(self):
        """The engine; a copy made by pickling or deepcopy builds its own on first use (see __getstate__)."""
        if self._engine is None:
            if not dist.is_initialized():
                raise RuntimeError("hsync.WeightedDDP: this copy of a wrapper (unpickled or deep-copied) "
                                   "synchronises over the default process group, so call "
                                   "torch.distributed.init_process_group() before training it, or use "
                                   "its .module alone")
            self._build_engine(dist.group.WORLD)
        return self._engine

    def __getstate__(self) -> dict:
        # As DDP: a copy keeps module and settings, not the communicator; it reduces over the default
        # group with an engine of its own, built when it is first trained (on every rank, as any step).
        if not self._uses_default_group:
            raise RuntimeError("hsync.WeightedDDP can be pickled or copied only when it uses the default "
                               "process group (no process_group or device_mesh argument), as with DDP; "
                               "pickle model.module instead")
        state = self.__dict__.copy()
        state.update(_engine=None, _group=None, _window=None, _plain_steps_join=None, require_forward_param_sync=False,
                     _before_sync=None)
        return state

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)  # DDP's would build a reducer
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduced over (None once it was destroyed)."""
        return self._group() if self._group is not None else None

    @property
    def parameters_to_ignore(self) -> set[str]:
        """As DDP's: the names of parameters and buffers neither reduced nor broadcast."""
        return _ignored_names(self.module)

    @property
    def cross_rank_backward(self) -> bool:
        """Whether the ranks' backward passes send gradients to each other (see the constructor): fixed at
        wrap time, the same on every rank."""
        return self._cross_rank_backward

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before forwards (DDP's name for forward_sync_buffers)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        # Settable, as DDP's (a plain attribute in torch 2.11, a property since).
        if not isinstance(value, bool):
            raise TypeError(f"hsync.WeightedDDP.broadcast_buffers must be a bool, got {value!r}")
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """As DDP's: whether the next forward broadcasts rank 0's buffers."""
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._synced_buffers())

    def _set_static_graph(self) -> None:
        """DDP's late form of static_graph=True, which hsync needs no more than the argument (see the README)."""
        self.static_graph = True

    def _register_buffer_comm_hook(self, *args, **kwargs) -> None:
        raise RuntimeError("hsync.WeightedDDP runs no buffer communication hooks (see 'Differences from DDP' "
                           "in the README)")

    def _register_fused_optim(self, *args, **kwargs) -> None:
        raise RuntimeError("hsync.WeightedDDP runs no optimizer inside backward (DDP's _register_fused_optim); "
                           "call optimizer.step() after backward")

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """DDP's built-in hooks, as their Python twins: ALLREDUCE as allreduce_hook, FP16_COMPRESS as
        fp16_compress_hook (see register_comm_hook)."""
        hook = _BUILTIN_HOOKS.get(comm_hook_type) if isinstance(comm_hook_type, dist.BuiltinCommHookType) else None
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
                            f"{_describe(new_process_group)}")
        if self._balanced:
            raise RuntimeError("hsync.WeightedDDP._update_process_group: an hsync.Balancer plans this wrapper's "
                               "steps for its ranks; wrap the model anew, with a new Balancer, for the new group")
        previous = self._engine
        self._build_engine(new_process_group)
        if previous is not None:
            previous.expect_gradients(False)  # a forward before this call no longer feeds a step
        self._uses_default_group = new_process_group == dist.group.WORLD
        self._plain_steps_join = None  # the new engine has not been told

    def to_kwargs(self, inputs: tuple, kwargs: dict | None, device_id: int) -> tuple[tuple, tuple[dict, ...]]:
        """As DDP's (kept there for old code): inputs and kwargs moved to device `device_id` of the module's type."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device.type, device_id),
                          self.use_side_stream_for_tensor_copies)

    def _declare_metrics(self, names: Sequence[str]) -> None:
        """Adds metric slots to the step's scalars, on every rank alike, between steps (hsync.Balancer's)."""
        if self._window is not None:
            raise RuntimeError("hsync.WeightedDDP: metrics can be added between steps only, not inside no_sync")
        self._balanced = True
        self.metric_names = (*self.metric_names, *(n for n in names if n not in self.metric_names))

    def _synced_buffers(self) -> list[torch.Tensor]:
        # Looked up each time, as DDP does: a buffer reassigned since wrap time is the one to send.
        ignored = _ignored_names(self.module)
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
        if self._join_config.enable and self.cross_rank_backward:
            # Refused before any collective, on every rank alike: under Join every rank runs forwards.
            raise RuntimeError("hsync.WeightedDDP under Join: a joined rank cannot shadow forwards and backwards "
                               "that are collectives themselves (cross_rank_backward, a SyncBatchNorm)")
        # As DDP: only a forward with gradients outside no_sync makes the next backward synchronise
        # (Note [Which backward synchronises] in csrc/engine.h).
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.device_ids and (inputs or kwargs):
            # torch's own move, as DDP's forward makes it (a PackedSequence keeps its batch sizes on the host).
            moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs, self.device, self.use_side_stream_for_tensor_copies)
            inputs, kwargs = moved_inputs[0], moved_kwargs[0]
        if self._engine is None and not synced and not self._join_config.enable:
            return inputs, kwargs, False  # a copy not trained yet: nothing to synchronise
        engine = self._ensure_engine()
        if synced:
            engine.expect_gradients(True)
            self._steps_begun = True
        buffers_due = self.require_forward_param_sync and self.forward_sync_buffers
        root = 0
        joining = self._join_config.enable
        plain_steps = self._divide_by_initial_world_size if joining else None
        if plain_steps != self._plain_steps_join:
            # Under Join plain steps carry step scalars too, so joined ranks can shadow them: Note [Join].
            plain = self._new_window().local
            plain[WEIGHT] = 1.0
            engine.set_join_plain_step(plain if joining else None, self._divide_by_initial_world_size)
            self._plain_steps_join = plain_steps
        if joining:
            Join.notify_join_context(self)
            _, _, root = self._exchange_join_info(synced, buffers_due, joined=False)
            self._join_announced = synced
        if buffers_due:
            buffers = self._synced_buffers()
            if buffers:
                engine.broadcast_coalesced(buffers, root)
        self.require_forward_param_sync = synced
        return inputs, kwargs, synced

    @torch._disable_dynamo
    def _finish_forward(self, output, synced: bool):
        if synced:
            _on_backward_start(output, self._engine.begin_backward)
        return output

    @property
    def bucket_bytes_cap(self) -> int:
        """As DDP's: the size in bytes at which torch.compile splits the module's graphs, so that each
        piece's gradients reach their buckets while backward goes on (`bucket_cap_mb`, but at least
        the first-bucket cap of dynamo's DDPOptimizer, which refuses anything smaller)."""
        return max(self._bucket_bytes_cap, dist._DEFAULT_FIRST_BUCKET_BYTES)

    @contextlib.contextmanager
    @torch._disable_dynamo(recursive=False)
    def _splitting_compiled_graphs(self) -> Iterator[None]:
        # A compiled graph's backward is one autograd node: every gradient in it arrives when it
        # ends, too late to overlap the all-reduces with backward. While DDP runs its module's
        # forward, dynamo splits each graph it compiles there at bucket_bytes_cap boundaries
        # (DDPOptimizer); it asks DDP's class which module is running, as torch's own `replicate`
        # answers for itself. Saved and restored, as DDP does, for nested wrappers.
        previous = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = self
        try:
            yield
        finally:
            DistributedDataParallel._active_ddp_module = previous

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """DDP's, for torch's hooks whose arithmetic hsync's pack does itself: `bf16_compress_hook` and
        `fp16_compress_hook`, or `bf16_compress_wrapper` / `fp16_compress_wrapper` around `allreduce_hook`,
        set `comm_dtype` (the cast then rides in the pack); `allreduce_hook` alone, the full-precision
        mean, sets comm_dtype=None. Any other hook is refused: hsync runs none.

        As with DDP, call it once, on every rank, before the first backward."""
        known, comm_dtype = _hook_comm_dtype(hook)
        refusal = self._comm_hook_refusal(state, hook, known)
        previous = self.comm_dtype
        if refusal is None:
            self.comm_dtype = comm_dtype
        try:
            # A collective on every rank, refused or not: a rank's refusal is then raised on every rank.
            self._build_engine(self.process_group or dist.group.WORLD, refusal)
        except BaseException:
            self.comm_dtype = previous
            raise
        self._hook_registered = True

    def _comm_hook_refusal(self, state: object, hook: Callable, known: bool) -> Exception | None:
        if not known:
            return ValueError(f"hsync.WeightedDDP runs no communication hooks, got {_describe(hook)}; torch's "
                              "bf16_compress_hook and fp16_compress_hook are taken as comm_dtype=torch.bfloat16 / "
                              "torch.float16, and allreduce_hook as comm_dtype=None (see 'Differences from DDP' "
                              "in the README)")
        if state is not None and state is not self.process_group:
            return ValueError("hsync.WeightedDDP.register_comm_hook: the hook's state must be None or the "
                              "wrapper's own process group")
        if self._hook_registered:
            return RuntimeError("register_comm_hook can only be called once, as with DDP")
        if self._steps_begun:
            return RuntimeError("register_comm_hook must be called before the first backward, as with DDP")
        return None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards inside it are not followed by a reduction (as DDP's).

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
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHook(self, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        return self.process_group

    def _exchange_join_info(self, synced: bool, buffers_due: bool, joined: bool) -> tuple[bool, bool, int]:
        """One all-reduce per forward under Join: whether a synced step and a buffer broadcast follow,
        and the lowest rank not joined, whose buffers are broadcast (rank 0 may have joined)."""
        info = [0.0] * (2 + self.world_size)
        if not joined:
            info[0], info[1], info[2 + self.rank] = float(synced), float(buffers_due), 1.0
        reduced = torch.tensor(info, dtype=torch.float64, device=self.device)
        engine = self._ensure_engine()
        engine.begin_peer_wait()  # Note [Busy time] in csrc/busy_clock.h
        try:
            dist.all_reduce(reduced, group=self.process_group)
            values = reduced.tolist()
        finally:
            engine.end_peer_wait()
        active = [r for r in range(self.world_size) if values[2 + r] > 0]
        return values[0] > 0, values[1] > 0, active[0] if active else 0

    def _shadow_iteration(self) -> None:
        """A joined rank's side of one iteration of the others (Note [Join] in csrc/engine.h)."""
        engine = self._ensure_engine()
        synced, buffers_due, root = self._exchange_join_info(False, False, joined=True)
        if buffers_due:
            engine.broadcast_coalesced(self._synced_buffers(), root)
        self.require_forward_param_sync = synced
        if synced:
            window = self._new_window()
            engine.begin_weighted_step(window.local, window.ref)
            engine.finalize_if_pending()
            host = engine.step_scalars()
            if host[BAD_RANKS] > 0:
                raise ValueError(_bad_input_message(host, None, self.rank))

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After Join: every rank takes the model of the highest-ranked last joiner, as DDP does."""
        candidate = torch.tensor([self.rank if is_last_joiner else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        tensors = [p.detach() for p in _reduced_parameters(self.module)]
        tensors += self._synced_buffers() if self.forward_sync_buffers else []
        self._ensure_engine().broadcast_coalesced(tensors, int(candidate.item()))

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
            raise ValueError(f"hsync: rank {self.rank}'s loss ({_describe(loss)}) does not require a gradient "
                             "(computed under no_grad, or detached?), but with cross_rank_backward every rank's "
                             "backward takes part in collectives that its peers are waiting in: this rank cannot "
                             "go on, and its peers fail when it exits or at their process group's timeout")
        if self._join_config.enable and self._join_announced != self.require_backward_grad_sync:
            raise RuntimeError("hsync: under join(), run each micro-step's forward in the same no_sync() "
                               "state as its backward: the joined ranks were told at the forward whether "
                               "this step synchronises")
        window = self._window or self._new_window()
        self._window = window
        w = self._add_micro_step(window, loss, weight, metrics or {})
        if not self.require_backward_grad_sync:
            engine.expect_gradients(False)  # accumulate, even after a forward outside no_sync
            # The window's next forward belongs to this step, whose buffers came with its first: one
            # broadcast per step, as DDP's under no_sync, however many micro-batches each rank runs.
            self.require_forward_param_sync = False
            try:
                self._backprop_micro_step(loss, w, window.ref)
            except BaseException as error:
                # Note [A backward that fails] in csrc/engine.h
                if self.cross_rank_backward:
                    engine.abandon_step(_backward_failure(error))
                window.local[LOSS_NONFINITE] += 1
                raise
            return None

        self._window = None
        scalars = window.local
        if window.problem is not None:
            scalars[BAD_RANKS] = 1
            scalars[BAD_KIND_SUM] = int(window.problem_kind)
        else:
            scalars[BAD_RANKS] = (window.out_of_range > 0).to(torch.float64)
            scalars[BAD_KIND_SUM] = scalars[BAD_RANKS] * int(BadInput.WEIGHT_OUT_OF_RANGE)
        scalars[BAD_RANK_SUM] = scalars[BAD_RANKS] * (self.rank + 1)

        engine.begin_weighted_step(scalars, window.ref)
        try:
            self._backprop_micro_step(loss, w, window.ref)
        except BaseException as error:
            # Note [A backward that fails] in csrc/engine.h
            if self.cross_rank_backward:
                engine.abandon_step(_backward_failure(error))
                raise
            engine.mark_step_failed()
            self._complete_step(engine)  # its peers are waiting in the step's collectives
            raise
        busy = self._complete_step(engine)
        engine.start_busy_interval()  # the next step's own work starts where this step ends
        # The next forward starts a step, whose buffers come with it, also after a window whose forwards
        # all ran under no_sync (a backward of a constant loss synchronised it): its peers broadcast them.
        self.require_forward_param_sync = True
        host = engine.step_scalars()
        if host[BAD_RANKS] > 0:
            raise ValueError(_bad_input_message(host, window.problem, self.rank))
        return self._step_stats(host, None if busy is None else busy.seconds)

    def _complete_step(self, engine) -> _C.BusyInterval | None:
        """Runs the weighted step's remaining collectives; returns this rank's own work since the last
        step ended, without its waits for peers (none after a step that failed): Note [Busy time] in
        csrc/busy_clock.h."""
        if self._before_sync is not None:
            self._before_sync()
        busy = engine.end_busy_interval()
        engine.finalize_if_pending()
        self._weighted_steps_done += 1
        return busy

    def _last_step_stats(self) -> StepStats:
        """The last completed weighted step's StepStats (without busy_seconds), for a caller whose backward
        raised after the step's collectives ran: hsync.Balancer then counts the step as its peers do."""
        return self._step_stats(self._ensure_engine().step_scalars(), None)

    def _window_backup(self) -> Callable[[], None]:
        """Restores the accumulation window as it is now: what a micro-step that failed added to it (its weight,
        its loss, the failure's non-finite mark) undone, for hsync.Balancer, which runs it again in parts."""
        saved = copy.deepcopy(self._window)

        def restore() -> None:
            self._window = saved

        return restore

    def _step_stats(self, host: torch.Tensor, busy: Callable[[], float] | None) -> StepStats:
        """The StepStats of the step whose reduced scalars are `host`."""
        engine = self._engine
        return StepStats(host, engine.last_grad_nonfinite(), self.metric_names, engine.check, busy)

    def _new_window(self) -> _Window:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=self.device)

        # A common unit on every rank when backward passes mix the ranks' gradients (cross_rank_backward),
        # else the window's first non-zero weight (set by _add_micro_step).
        ref = zeros().fill_(1.0) if self.cross_rank_backward else zeros()
        return _Window(local=zeros(NUM_SLOTS + len(self.metric_names)), ref=ref, out_of_range=zeros())

    def _add_micro_step(self, window: _Window, loss, weight, metrics) -> torch.Tensor | None:
        """Adds this micro-step to the window; returns its weight, or None if its input is bad."""
        w, kind, problem = _as_weight(weight, self.device)
        if kind is None and not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            kind, problem = BadInput.BAD_LOSS, f"loss must be a scalar floating-point tensor, got {_describe(loss)}"
        elif kind is None and not loss.requires_grad and not (isinstance(weight, numbers.Real) and weight == 0):
            # Only a rank with nothing to contribute may pass a constant loss.
            kind, problem = BadInput.BAD_LOSS, "loss does not require a gradient (computed under no_grad, or detached?)"
        values, metric_problem = self._metric_values(metrics)
        if kind is None and metric_problem:
            kind, problem = BadInput.BAD_METRIC, metric_problem
        if kind is not None:
            if window.problem is None:
                window.problem, window.problem_kind = problem, kind
            return None

        # A tensor weight is checked on its device: no synchronisation with the host.
        out_of_range = ~torch.isfinite(w) | (w < 0)
        w = torch.where(out_of_range, 0.0, w)
        window.out_of_range += out_of_range
        window.ref = torch.where(window.ref > 0, window.ref, w)
        lossd = loss.detach().reshape(()).to(torch.float64)
        local = window.local
        local[WEIGHT] += w
        # A rank without data adds nothing to the loss, but its non-finite values still count.
        local[LOSS_SUM] += torch.where(w > 0, w * lossd, 0.0)
        local[LOSS_NONFINITE] += (~torch.isfinite(lossd)).to(torch.float64)
        if values is not None:
            local[NUM_SLOTS:] += values
        return w

    def _metric_values(self, metrics: Mapping) -> tuple[torch.Tensor | None, str | None]:
        """The declared metrics as one float64 vector, or why they cannot be."""
        unknown = sorted(set(metrics) - set(self.metric_names))
        if unknown:
            return None, f"metrics {unknown} were not declared in WeightedDDP(metric_names={self.metric_names})"
        if not metrics:
            return None, None
        values: list[torch.Tensor | float] = []
        for name in self.metric_names:
            value = metrics.get(name, 0.0)
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
                values.append(value.detach().reshape(()).to(device=self.device, dtype=torch.float64))
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                values.append(float(value))
            else:
                return None, f"metric '{name}' must be a real number, got {_describe(value)}"
        if all(isinstance(v, float) for v in values):
            return _to_device(values, self.device), None
        as_tensors = [v if isinstance(v, torch.Tensor) else _to_device([v], self.device)[0] for v in values]
        return torch.stack(as_tensors), None

    def _backprop_micro_step(self, loss, weight: torch.Tensor | None, ref: torch.Tensor) -> None:
        """Backpropagates the micro-step's loss, scaled to `ref`'s units; `weight` None: its input was bad."""
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


class _Absent:
    """A name of DDP's class that WeightedDDP does not have (_DDP_MACHINERY): reading it raises
    AttributeError, as for any missing attribute."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type | None = None) -> NoReturn:
        raise AttributeError(f"hsync.WeightedDDP has no {self.name!r}: it is DDP's own machinery, which hsync "
                             "replaces")


for _name in _DDP_MACHINERY:
    setattr(WeightedDDP, _name, _Absent(_name))


class _JoinHook(JoinHook):
    """How a WeightedDDP takes part in torch's Join once its rank has run out of inputs."""

    def __init__(self, model: WeightedDDP, divide_by_initial_world_size: bool) -> None:
        self.model = model
        model._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.model._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.model._sync_final_model(is_last_joiner)


def _hook_comm_dtype(hook: Callable) -> tuple[bool, torch.dtype | None]:
    """Whether `hook` is one of torch's hooks that hsync's pack does itself, and the comm_dtype it means."""
    try:
        if hook in _HOOK_COMM_DTYPES:
            return True, _HOOK_COMM_DTYPES[hook]
    except TypeError:  # an unhashable callable: none of torch's
        return False, None
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
    if code in _WRAPPER_CODE_COMM_DTYPES and [c.cell_contents for c in cells] == [default_hooks.allreduce_hook]:
        return True, _WRAPPER_CODE_COMM_DTYPES[code]
    return False, None


def _on_backward_start(output, callback: Callable[[], None]) -> None:
    """Calls `callback` when backward reaches an output tensor (Note [Nested backwards] in csrc/engine.h)."""
    nodes = {id(t.grad_fn): t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(lambda grad_outputs: callback())


def _tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output, where DDP's _find_tensors looks for them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, Mapping):  # dicts, and transformers' ModelOutput
        for item in value.values():
            yield from _tensors_in(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            yield from _tensors_in(getattr(value, field.name))


def _ignored_names(module: nn.Module) -> set[str]:
    """Names DDP's _set_params_and_buffers_to_ignore_for_model marked: neither reduced nor broadcast."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def _reduced_parameters(module: nn.Module, named: bool = False) -> list:
    ignored = _ignored_names(module)
    pairs = [(name, p) for name, p in module.named_parameters() if name not in ignored]
    return pairs if named else [p for _, p in pairs]


def _check_device_ids(device_ids, output_device, device: torch.device) -> tuple[list[int] | None, int | None]:
    """DDP's rules for device_ids and output_device, for a module on `device`."""
    if device_ids is not None and not isinstance(device_ids, Sequence):
        raise TypeError(f"device_ids must be None or a list of one device, got {_describe(device_ids)}")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    if not device_ids or device.type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError("hsync.WeightedDDP device_ids and output_device arguments only work with "
                             f"single-device GPU modules or CPU modules, but got device_ids {device_ids}, "
                             f"output_device {output_device}, and module parameters on {device}.")
        return None, None
    index = _device_index(device_ids[0], device)
    if index != device.index:
        raise ValueError(f"device_ids {list(device_ids)} name another device than the module's parameters, "
                         f"which are on {device}")
    return [index], _device_index(device_ids[0] if output_device is None else output_device, device)


def _device_index(value, device: torch.device) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str | torch.device) and torch.device(value).type == device.type:
        return torch.device(value).index if torch.device(value).index is not None else 0
    raise ValueError(f"expected a {device.type} device index or device, got {_describe(value)}")


def _to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers as a float64 tensor on `device`, without waiting for the device's queue."""
    host = torch.tensor(values, dtype=torch.float64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _as_weight(weight, device: torch.device) -> tuple[torch.Tensor, BadInput | None, str | None]:
    """The weight as a float64 scalar on `device`; host-side numbers are checked here, tensors on device."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
            return zero, BadInput.WEIGHT_NOT_A_NUMBER, f"weight must be a real scalar, got {_describe(weight)}"
        return weight.detach().reshape(()).to(device=device, dtype=torch.float64), None, None
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        return zero, BadInput.WEIGHT_NOT_A_NUMBER, f"weight must be a real number, got {_describe(weight)}"
    value = float(weight)
    if not math.isfinite(value) or value < 0:
        return zero, BadInput.WEIGHT_OUT_OF_RANGE, f"weight must be finite and non-negative, got {value}"
    return torch.full((), value, dtype=torch.float64, device=device), None, None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _backward_failure(error: BaseException) -> str:
    return (f"backward raised {type(error).__name__}: {error}. With cross_rank_backward its peers may be waiting "
            "in collectives of the backward pass, so the step cannot complete; rebuild the wrapper (or restart) "
            "to go on")


def _bad_input_message(host: torch.Tensor, own_problem: str | None, rank: int) -> str:
    count = int(host[BAD_RANKS])
    if count == 1:
        kind = BadInput(round(float(host[BAD_KIND_SUM])))
        who = f"rank {int(host[BAD_RANK_SUM]) - 1} passed {kind.describe()}"
    else:
        who = f"{count} ranks passed bad input (a negative, NaN, infinite or non-numeric weight, or a bad loss)"
    mine = f"; on this rank ({rank}): {own_problem}" if own_problem else ""
    return f"hsync: WeightedDDP.backward: {who}{mine}. The step was not applied; no rank took it."


def _resolve_timeout(timeout: datetime.timedelta | None) -> float:
    """The collective deadline in seconds, from the argument, else HSYNC_TIMEOUT, else DEFAULT_TIMEOUT."""
    if timeout is None:
        text = os.environ.get("HSYNC_TIMEOUT")
        try:
            seconds = float(text) if text else DEFAULT_TIMEOUT.total_seconds()
        except ValueError:
            raise ValueError(f"HSYNC_TIMEOUT must be a number of seconds, got {text!r}") from None
    elif isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        raise TypeError(f"timeout must be a datetime.timedelta, got {_describe(timeout)}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"the collective timeout must be positive and finite, got {seconds} s")
    if seconds > _MAX_TIMEOUT.total_seconds():
        raise ValueError(f"the collective timeout must be at most {_MAX_TIMEOUT.days} days, got {seconds} s")
    return seconds


def _make_comm(group: dist.ProcessGroup, device: torch.device, timeout_s: float, engine_key: str):
    """The engine's communicator: NCCL of our own on GPU (Note [NCCL bootstrap]), the process group on CPU.
    `engine_key`: the same on every rank of the group, and used by no other engine over it."""
    # Keys unique to this engine and this attempt: torchrun may restart workers on the same store.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hsync/{attempt}/{engine_key}"
    store = dist.distributed_c10d._get_default_store()
    debug = os.environ.get("HSYNC_DEBUG_COLLECTIVES", "0") not in ("", "0")
    faults = _C.FaultOptions(store, f"{prefix}/failure", timeout_s, debug)
    if device.type != "cuda":
        return _C.ProcessGroupComm(group, faults)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        store.set(f"{prefix}/nccl-id", _C.nccl_unique_id())
    return _C.NcclComm(bytes(store.get(f"{prefix}/nccl-id")), rank, world_size, device.index, faults)


def _model_signature(module: nn.Module) -> tuple[list[tuple], list[str]]:
    """What must match across ranks, and this rank's problems that no rank could work with."""
    ignored = _ignored_names(module)
    signature = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
                 for name, p in _reduced_parameters(module, named=True)]
    signature += [("buffer", name, tuple(b.shape), str(b.dtype), False)
                  for name, b in module.named_buffers() if name not in ignored]
    problems = []
    devices = sorted({str(p.device) for p in _reduced_parameters(module)})
    if len(devices) > 1:
        problems.append(f"parameters on several devices ({', '.join(devices)}); wrap a single-device module")
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.sparse:
            problems.append(f"'{name}' produces sparse gradients (sparse=True); hsync reduces dense gradients only")
    for name, p in _reduced_parameters(module, named=True):
        if hasattr(p, "_in_backward_optimizers"):
            # Its optimizer would step on the local gradient, before any reduction: ranks would drift apart.
            problems.append(f"parameter '{name}' has an optimizer applied in backward (torch's "
                            "_apply_optimizer_in_backward), which hsync does not run; step the optimizer "
                            "after backward")
            break
    return signature, problems


def gather_objects(obj: object, group: dist.ProcessGroup | None, device: torch.device) -> list:
    """dist.all_gather_object with `device` as the current CUDA device, where NCCL carries it: torch's
    uses the current one, cuda:0 on every rank of a program that never called torch.cuda.set_device
    (as DDP's users need not), which NCCL refuses as one GPU used twice."""
    gathered: list = [None] * dist.get_world_size(group)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _verify_same_model(group: dist.ProcessGroup, device: torch.device, module: nn.Module,
                       settings: dict[str, object], refusal: Exception | None, engine_index: int) -> int:
    """Raises the same error on every rank if a rank refused (its `refusal`, naming the rank), the ranks'
    models or `settings` differ (RuntimeError, as DDP's) or one cannot be wrapped (ValueError); else
    returns the engine index the ranks agree on (the largest `engine_index` proposed)."""
    gathered = gather_objects((*_model_signature(module), settings, refusal, engine_index), group, device)
    for rank, (*_, theirs, _) in enumerate(gathered):
        if theirs is not None:
            raise type(theirs)(f"{theirs} (on rank {rank})")
    for rank, (_, problems, *_) in enumerate(gathered):
        if problems:
            raise ValueError(f"hsync: cannot wrap the model: on rank {rank}, {problems[0]}")
    for rank, (_, _, theirs, *_) in enumerate(gathered[1:], start=1):
        for name, value in gathered[0][2].items():
            if theirs[name] != value:
                raise RuntimeError(f"hsync.WeightedDDP: {name} differs across ranks: {value} on rank 0, "
                                   f"{theirs[name]} on rank {rank}")
    reference = gathered[0][0]
    for rank, (signature, *_) in enumerate(gathered[1:], start=1):
        difference = _first_difference(reference, signature, rank)
        if difference:
            raise RuntimeError(f"hsync: the model differs across ranks: {difference}")
    return max(proposed for *_, proposed in gathered)


def _first_difference(reference: list[tuple], other: list[tuple], rank: int) -> str | None:
    def show(entry: tuple) -> str:
        kind, name, shape, dtype, requires_grad = entry
        frozen = "" if requires_grad or kind == "buffer" else ", frozen"
        return f"{kind} '{name}' of shape {list(shape)}, {dtype}{frozen}"

    for index, (mine, theirs) in enumerate(zip(reference, other, strict=False)):
        if mine != theirs:
            return f"entry #{index}: rank 0 has {show(mine)}, rank {rank} has {show(theirs)}"
    if len(reference) != len(other):
        longer, which = (reference, 0) if len(reference) > len(other) else (other, rank)
        return (f"rank 0 has {len(reference)} parameters and buffers, rank {rank} has {len(other)} "
                f"(first extra on rank {which}: {show(longer[min(len(reference), len(other))])})")
    return None
