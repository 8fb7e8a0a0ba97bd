"""The process group hsync's wrapper syncs over, where a framework runs without one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def ensure_process_group(device: torch.device) -> None:
    """A world of one for a plain `python train.py`: Trainer and Accelerate run one process without a process
    group (they wrap no DDP then), but hsync.WeightedDDP, like DDP, needs one, if only of itself."""
    if dist.is_initialized():
        return
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1:  # the framework saw a launch but started no group: it would be waited on forever
        raise RuntimeError(f"hsync: the launcher started {launched} processes but no process group exists; start "
                           "the ranks with torchrun (or accelerate launch)")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=device if device.type == "cuda" else None)
