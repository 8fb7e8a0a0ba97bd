"""DDP's surface as WeightedDDP meets it: the hooks it recognises, the machinery it leaves out, and DDP's
rules for which parameters, outputs and devices count."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hsync.errors import describe

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
    "_register_delay_all_reduce_hook", "_remove_autograd_hooks", "_root_copy_hook", "_run_ddp_forward",
    "_set_ddp_runtime_logging_sample_rate", "_set_sparse_metadata", "_setup_in_backward_optimizers",
    "_sync_buffers", "_sync_final_model", "_sync_module_buffers",
)


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
        return torch.device(value).index if torch.device(value).index is not None else 0
    raise ValueError(f"expected a {device.type} device index or device, got {describe(value)}")
