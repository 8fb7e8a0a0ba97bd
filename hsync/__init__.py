"""hsync: instance-weighted gradient synchronisation for data-parallel PyTorch on mixed GPUs."""

from hsync._extension import _C  # noqa: F401 - loaded first: it refuses a missing or CPU-only build
from hsync.balance import BalanceConfig, Balancer
from hsync.ddp import WeightedDDP
from hsync.evaluation import ShardSampler, sum_over_ranks
from hsync.stats import StepStats

__all__ = ["BalanceConfig", "Balancer", "ShardSampler", "StepStats", "WeightedDDP", "sum_over_ranks"]
__version__ = "0.1.0"
