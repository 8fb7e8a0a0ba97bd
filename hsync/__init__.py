"""hsync: instance-weighted gradient synchronisation for data-parallel PyTorch on mixed GPUs."""

# Before the program's init_process_group, so that no later import (torch.optim's first optimizer
# loads torch._dynamo, which loads it) evaluates its `group=group.WORLD` defaults while a default
# group exists: kept there, the group outlives destroy_process_group(), and a gloo thread still
# releasing a collective while the interpreter shuts down aborts the process (torch 2.14.1).
import torch.distributed.nn  # noqa: F401

from hsync._extension import _C  # noqa: F401 - before the rest of hsync: it refuses a missing or CPU-only build
from hsync.balance import BalanceConfig, Balancer
from hsync.ddp import WeightedDDP
from hsync.evaluation import ShardSampler, sum_over_ranks
from hsync.sharding import ShardedOptimizer
from hsync.stats import StepStats

__all__ = ["BalanceConfig", "Balancer", "ShardSampler", "ShardedOptimizer", "StepStats", "WeightedDDP",
           "sum_over_ranks"]
__version__ = "0.1.0"
