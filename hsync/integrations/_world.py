"""What every integration checks before wrapping: a framework release it was tested with, a model that is not
wrapped already, and the process group hsync's wrapper syncs over, where a framework runs without one; and what
it does after: the framework's own collectives put under hsync's deadline."""

from __future__ import annotations

import atexit
import os
import sys
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version
from torch import nn

import hsync
from hsync.bootstrap import wrapper_kind
from hsync.collectives import Channels, put_torch_groups_under_the_deadline

# Each framework's supported releases, [lowest, first unsupported): the integrations reach into hooks and
# attributes that a framework may change in a release (their Notes say which). The tests ran on transformers
# 5.23, accelerate 1.15 and lightning 2.6.
SUPPORTED = {
    "transformers": ("5.0", "6"),
    "accelerate": ("1.1", "2"),
    "lightning": ("2.4", "3"),
}


def check_framework_version(framework: ModuleType) -> None:
    """Refuses a release of `framework` (the module the integration imported) outside SUPPORTED, in one line
    naming both."""
    name = framework.__name__
    lowest, unsupported = SUPPORTED[name]
    found = framework.__version__
    if not Version(lowest) <= Version(found) < Version(unsupported):
        raise RuntimeError(f"hsync.integrations.{name} supports {name} >= {lowest}, < {unsupported}; found {found}")


def wrap(model: nn.Module, device: torch.device, **options: Any) -> hsync.WeightedDDP:
    """hsync's wrapper around the framework's model, in a world of its own where the framework started none, with
    the framework's own collectives put under its deadline."""
    ensure_process_group(device)
    weighted = hsync.WeightedDDP(model, **options)
    put_the_frameworks_collectives_under_the_deadline(weighted)
    return weighted


def ensure_process_group(device: torch.device) -> None:
    """A world of one for a plain `python train.py`: Trainer and Accelerate run one process without a process
    group (they wrap no DDP then), but hsync.WeightedDDP, like DDP, needs one, if only of itself. The group is
    ended at the program's exit (_end_at_exit)."""
    if not dist.is_initialized():
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1:  # the framework saw a launch but started no group: it would be waited on forever
            raise RuntimeError(f"hsync: the launcher started {launched} processes but no process group exists; "
                               "start the ranks with torchrun (or accelerate launch)")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    global _ending_at_exit
    if not _ending_at_exit:
        _ending_at_exit = True
        atexit.register(_end_at_exit)


_ending_at_exit = False


def _end_at_exit() -> None:
    """transformers' Trainer and Accelerate leave the process group to the interpreter's shutdown, where a gloo
    thread that releases a collective's tensors (an evaluation's all-gather) waits for the interpreter and aborts
    the process ("terminate called without an active exception": 3 exits in 25 of a plain DDP Trainer run on two
    CPU ranks, none in 24 with this). Lightning ends its group at exit, and so does this, after a run that did
    not fail: after a failure the group's end would wait for gloo's threads, until gloo's own deadline."""
    if dist.is_initialized() and not hasattr(sys, "last_value") and not Channels.failed():
        dist.destroy_process_group()


def refuse_a_wrapped_model(model: nn.Module | None, who: str) -> None:
    """One line, before any work, for a model already wrapped in DDP, DataParallel or FSDP: hsync wraps the
    bare module itself, and the inner wrapper's collectives would wait on ranks that run other micro-batches."""
    wrapping = wrapper_kind(model) if isinstance(model, nn.Module) else None
    if wrapping:
        raise TypeError(f"{who}: the model is already wrapped in {wrapping}; pass the module inside it (its "
                        ".module): hsync wraps it itself")


def put_the_frameworks_collectives_under_the_deadline(weighted: hsync.WeightedDDP) -> None:
    """The framework's own collectives (Lightning's SIGTERM broadcast before every batch, Accelerate's
    gather_for_metrics in the Trainer's evaluation, a barrier around a checkpoint) run on torch's process groups,
    under their timeout: 30 minutes by default, so a frozen peer left the other ranks waiting there that long,
    silent, although hsync's own collectives would have ended at its deadline. From the wrap on, the default
    group and the model's take hsync's deadline (hsync.collectives.put_torch_groups_under_the_deadline)."""
    put_torch_groups_under_the_deadline([dist.GroupMember.WORLD, weighted.process_group], weighted.timeout)
