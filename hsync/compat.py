"""DDP's surface as WeightedDDP meets it: its arguments parsed into WrapSettings, the hooks it recognises, the
machinery it leaves out, and DDP's rules for which parameters, outputs and devices count."""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import ClassVar, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hsync._extension import _C
from hsync.collectives import resolve_timeout
from hsync.errors import describe

MIB = 1024 * 1024
COMM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# torch's hooks whose arithmetic the pack does itself, and the comm_dtype each means. A wrapper such as
# bf16_compress_wrapper(allreduce_hook) is a closure, recognised by its code and the hook it closes over.
_HOOK_COMM_DTYPES = {default_hooks.allreduce_hook: None, default_hooks.bf16_compress_hook: torch.bfloat16,
                     default_hooks.fp16_compress_hook: torch.float16}
_WRAPPER_CODE_COMM_DTYPES = {default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook).__code__: torch.bfloat16,
                             default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook).__code__: torch.float16}
BUILTIN_HOOKS = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
# torch releases after 2.11 deprecate broadcast_buffers in favour of forward_sync_buffers, and warn.
DDP_DEPRECATES_BROADCAST_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters

# DDP's reducer, logger, and forward and buffer plumbing, which hsync replaces. Inherited, each would fail
# reaching for state a WeightedDDP does not have; absent, `hasattr` tells the truth and a call names the
# attribute. Every other name of DDP's class is hsync's own or inherited on purpose: see
# test_every_attribute_of_ddps_class_is_hsyncs_own_inherited_on_purpose_or_absent.
DDP_MACHINERY = (
    "_assign_modules_buffers", "_build_debug_param_to_name_mapping", "_build_params_for_reducer",
    "_check_and_sync_module_buffers", "_check_comm_hook", "_check_default_group",
    "_check_global_requires_backward_grad_sync", "_check_reducer_finalized", "_check_sync_bufs_post_fwd",
    "_check_sync_bufs_pre_fwd", "_clear_grad_buffer", "_ddp_init_helper", "_default_broadcast_coalesced",
    "_delayed_all_reduce_hook", "_distributed_broadcast_coalesced", "_find_common_rank",
    "_fire_reducer_autograd_hook", "_get_ddp_logging_data", "_lazy_init", "_log_and_throw",
    "_match_all_reduce_for_bwd_pass", "_match_unused_params_allreduce", "_module_wait_for_copy_hook",
    "_passing_sync_batchnorm_handle", "_post_forward", "_pre_forward", "_register_accum_grad_hook",
    "_register_delay_all_reduce_hook", "_root_copy_hook", "_run_ddp_forward",
    "_set_ddp_runtime_logging_sample_rate", "_set_sparse_metadata", "_setup_in_backward_optimizers",
    "_sync_buffers", "_sync_final_model", "_sync_module_buffers",
)


@dataclass(frozen=True)
class WrapSettings:
    """WeightedDDP's arguments, checked once (WrapSettings.parse) and kept as one value: a copy of the wrapper
    carries them, and a call that changes one (register_comm_hook's comm_dtype, a Balancer's metric names, a
    DDP attribute assigned) replaces them whole (`changed`)."""

    dim: int
    """DDP's `dim`: meaningless for a single-device module, kept for code that reads it."""
    init_sync: bool
    """Whether wrapping broadcasts rank 0's parameters (and buffers: `init_buffers`) to every rank."""
    init_buffers: bool
    """Whether that broadcast takes the buffers too (not with broadcast_buffers=False alone)."""
    forward_sync_buffers: bool
    """Whether each forward that follows a synchronised one first receives rank 0's buffers."""
    find_unused_parameters: bool
    """DDP's flag, accepted: hsync finds unused parameters always."""
    static_graph: bool
    """DDP's flag, accepted: hsync needs no static graph."""
    gradient_as_bucket_view: bool
    """Whether each .grad is a view into its bucket (no second copy of the gradients)."""
    skip_all_reduce_unused_params: bool
    """DDP's flag, accepted: changes nothing."""
    batched_grad_copy: bool
    """DDP's flag, accepted: changes nothing."""
    bucket_bytes_cap: int
    """The bytes (of the wire's dtype) at which a bucket is full."""
    first_bucket_bytes_cap: int
    """The first bucket's cap, kept small so that communication starts early."""
    timeout_s: float
    """How long any one collective may take before this rank gives up with an error naming the peer."""
    comm_dtype: torch.dtype | None
    """The dtype gradients travel in; None: each gradient's own."""
    cross_rank_backward: bool
    """Whether the ranks' backward passes send gradients to each other (a SyncBatchNorm)."""
    cross_rank_backward_found: bool
    """Whether cross_rank_backward is found in the module (a SyncBatchNorm, the argument left None) rather than
    given: a SyncBatchNorm converted in after the wrap is then found too (WeightedDDP's
    _find_sync_batch_norms_added_since_the_wrap)."""
    metric_names: tuple[str, ...]
    """The names of the extra sums that backward(..., metrics={...}) may report."""

    # What a program may assign after wrapping, as on DDP: the flags that change nothing in hsync, and the buffer
    # broadcast, which later forwards follow (torch's own code assigns static_graph).
    ASSIGNABLE: ClassVar[tuple[str, ...]] = ("find_unused_parameters", "static_graph", "skip_all_reduce_unused_params",
                                             "batched_grad_copy", "forward_sync_buffers")

    @classmethod
    def parse(cls, module: nn.Module, *, dim, broadcast_buffers, init_sync, bucket_cap_mb, find_unused_parameters,
              check_reduction, gradient_as_bucket_view, static_graph, delay_all_reduce_named_params,
              param_to_hook_all_reduce, mixed_precision, skip_all_reduce_unused_params, bucket_cap_mb_list,
              batched_grad_copy, forward_sync_buffers, first_bucket_cap_mb, metric_names,
              timeout: datetime.timedelta | None, comm_dtype, cross_rank_backward) -> WrapSettings:
        """The settings of WeightedDDP(module, ...) (its arguments by name), or the error that names a bad one."""
        flags = dict(init_sync=init_sync, find_unused_parameters=find_unused_parameters,
                     check_reduction=check_reduction, gradient_as_bucket_view=gradient_as_bucket_view,
                     static_graph=static_graph, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                     batched_grad_copy=batched_grad_copy)
        for name, value in flags.items():
            check_flag(name, value)
        for name, value in dict(broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers,
                                cross_rank_backward=cross_rank_backward).items():
            if value is not None:
                check_flag(name, value)
        unsupported = dict(delay_all_reduce_named_params=delay_all_reduce_named_params,
                           param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                           bucket_cap_mb_list=bucket_cap_mb_list)
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"hsync.WeightedDDP does not support DDP's {name}; leave it unset "
                                 "(see docs/ddp-compat.md)")
        if check_reduction:
            warnings.warn("The `check_reduction` argument is deprecated (as in DDP) and has no effect.",
                          FutureWarning, stacklevel=3)
        if broadcast_buffers is not None and DDP_DEPRECATES_BROADCAST_BUFFERS:
            warnings.warn("`broadcast_buffers` is deprecated (as in this torch's DDP) and ignored when "
                          "`forward_sync_buffers` is given" if forward_sync_buffers is not None else
                          "`broadcast_buffers` is deprecated (as in this torch's DDP); use `forward_sync_buffers`, "
                          "which, unlike `broadcast_buffers=False`, still broadcasts rank 0's buffers at wrap time",
                          FutureWarning, stacklevel=3)
        if not isinstance(dim, int):
            raise TypeError(f"hsync.WeightedDDP: dim must be an int, got {describe(dim)}")
        if first_bucket_cap_mb is None:  # DDP's: its own small first bucket by default, else the cap given
            first_bucket_cap_mb = _C.default_first_bucket_bytes_cap / MIB if bucket_cap_mb is None else bucket_cap_mb
        bucket_cap_mb = _C.default_bucket_bytes_cap / MIB if bucket_cap_mb is None else bucket_cap_mb
        for name, cap in dict(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb).items():
            if not isinstance(cap, numbers.Real) or isinstance(cap, bool):
                raise TypeError(f"hsync.WeightedDDP: {name} must be a number of MiB, got {describe(cap)}")
            if not 0 < cap < math.inf:
                raise ValueError(f"hsync.WeightedDDP: {name} must be a positive and finite number of MiB, got {cap}")
        if isinstance(metric_names, str | bytes) or not isinstance(metric_names, Sequence) or not all(
                isinstance(name, str) for name in metric_names):
            raise TypeError(f"hsync.WeightedDDP: metric_names must be a list or tuple of names, got "
                            f"{describe(metric_names)}")
        if len(set(metric_names)) < len(metric_names) or not all(metric_names):
            raise ValueError(f"hsync.WeightedDDP: metric_names must be distinct and not empty, got {metric_names}")
        if comm_dtype is not None and comm_dtype not in COMM_DTYPES:
            raise (ValueError if isinstance(comm_dtype, torch.dtype) else TypeError)(
                f"hsync.WeightedDDP: comm_dtype must be None or one of "
                f"{', '.join(map(str, COMM_DTYPES))}, got {describe(comm_dtype)}")
        return cls(
            dim=dim, init_sync=init_sync,
            # broadcast_buffers=False also skips the buffers at wrap time; forward_sync_buffers=False does not.
            init_buffers=forward_sync_buffers is not None or broadcast_buffers is not False,
            forward_sync_buffers=forward_sync_buffers if forward_sync_buffers is not None else (
                broadcast_buffers is not False),
            find_unused_parameters=find_unused_parameters, static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params, batched_grad_copy=batched_grad_copy,
            bucket_bytes_cap=int(bucket_cap_mb * MIB), first_bucket_bytes_cap=int(first_bucket_cap_mb * MIB),
            timeout_s=resolve_timeout(timeout), comm_dtype=comm_dtype,
            cross_rank_backward=cross_rank_backward if cross_rank_backward is not None else holds_sync_batch_norm(
                module),
            cross_rank_backward_found=cross_rank_backward is None, metric_names=tuple(metric_names))

    def changed(self, **values) -> WrapSettings:
        """These settings with `values` in place of their own."""
        return dataclasses.replace(self, **values)

    def that_must_agree(self, communication_hook: str) -> dict[str, object]:
        """What shapes the collectives: ranks that disagree would send buckets that don't match, or step scalars
        of other lengths or in another order (the metrics')."""
        return dict(comm_dtype=self.comm_dtype, communication_hook=communication_hook,
                    bucket_cap_mb=self.bucket_bytes_cap / MIB, first_bucket_cap_mb=self.first_bucket_bytes_cap / MIB,
                    cross_rank_backward=self.cross_rank_backward, metric_names=self.metric_names)


class Setting:
    """A public attribute of WeightedDDP (DDP's name) that reads its WrapSettings. Assigning one of
    WrapSettings.ASSIGNABLE replaces the settings; the others are fixed at wrap time."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner: type | None = None):
        return self if instance is None else getattr(instance._settings, self.name)

    def __set__(self, instance, value) -> None:
        if self.name not in WrapSettings.ASSIGNABLE:
            raise AttributeError(f"hsync.WeightedDDP.{self.name} is fixed at wrap time; pass it to the constructor")
        check_flag(self.name, value)
        instance._settings = instance._settings.changed(**{self.name: value})


def holds_sync_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())


def in_distributed_autograd() -> bool:
    """Whether this thread runs inside torch's distributed autograd context (RPC's dist_autograd.context()), where
    dist_autograd.backward leaves gradients in the context instead of .grad: DDP decides so at its forward too."""
    if not (dist.rpc.is_available() and dist.rpc.api._is_current_rpc_agent_set()):
        return False
    try:
        torch.distributed.autograd._current_context()
    except RuntimeError:  # no context on this thread
        return False
    return True


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"hsync.WeightedDDP: {name} must be True or False, got {describe(value)}")


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh) -> dist.ProcessGroup:
    """The group that DDP's `process_group` or 1-D `device_mesh` argument names (the default group if neither)."""
    if not dist.is_initialized():
        raise RuntimeError("hsync.WeightedDDP needs torch.distributed.init_process_group() first")
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    return process_group or dist.group.WORLD


class _Absent:
    """A name of DDP's class that WeightedDDP does not have (DDP_MACHINERY): reading it raises
    AttributeError, as for any missing attribute."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type | None = None) -> NoReturn:
        raise AttributeError(f"hsync.WeightedDDP has no {self.name!r}: it is DDP's own machinery, which hsync "
                             "replaces")


def leave_out_machinery(cls: type) -> None:
    """Makes each name of DDP_MACHINERY absent from `cls`, a subclass of DDP's."""
    for name in DDP_MACHINERY:
        setattr(cls, name, _Absent(name))


def hook_comm_dtype(hook: Callable) -> tuple[bool, torch.dtype | None]:
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


def comm_hook_signature_refusal(hook: object) -> Exception | None:
    """DDP's checks of a communication hook at registration (its _check_comm_hook), with its messages: callable,
    its `bucket` annotated as a GradBucket and its return as a Future of a tensor where annotated. Annotations
    postponed as strings (`from __future__ import annotations`) are evaluated first (DDP would compare the
    strings); where they cannot be, they are not checked."""
    if not callable(hook):
        return TypeError(f"Communication hook must be callable. register_comm_hook takes hook(state, bucket), got "
                         f"{describe(hook)}")
    try:
        signature = inspect.signature(hook, eval_str=True)
    except Exception:  # noqa: BLE001 - no signature, or annotations that do not evaluate: nothing to check
        return None
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        return ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        return ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")
    return None


def is_zero_overlap_hook(hook: object) -> bool:
    """torch's hook_with_zero_step and hook_with_zero_step_interleaved: they step a ZeroRedundancyOptimizer
    from inside DDP's buckets, reading DDP's reducer (its rebuilt buckets), which a WeightedDDP has not."""
    return getattr(hook, "__module__", None) == "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"


def tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output, where DDP's _find_tensors looks for them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, Mapping):  # dicts, and transformers' ModelOutput
        for item in value.values():
            yield from tensors_in(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            yield from tensors_in(getattr(value, field.name))


def ignored_names(module: nn.Module) -> set[str]:
    """Names DDP's _set_params_and_buffers_to_ignore_for_model marked: neither reduced nor broadcast."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def reduced_parameters(module: nn.Module, named: bool = False) -> list:
    """The module's parameters that DDP would reduce (not ignored), with their names if `named`."""
    ignored = ignored_names(module)
    pairs = [(name, p) for name, p in module.named_parameters() if name not in ignored]
    return pairs if named else [p for _, p in pairs]


def check_device_ids(device_ids, output_device, device: torch.device) -> tuple[list[int] | None, int | None]:
    """DDP's rules for device_ids and output_device, for a module on `device`."""
    if device_ids is not None and not isinstance(device_ids, Sequence):
        raise TypeError(f"device_ids must be None or a list of one device, got {describe(device_ids)}")
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
        # As DDP reads it: a device without an index is the current one of its type.
        return torch._utils._get_device_index(torch.device(value), optional=True)
    raise ValueError(f"expected a {device.type} device index or device, got {describe(value)}")
