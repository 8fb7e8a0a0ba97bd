"""hsync: instance-weighted gradient synchronisation for data-parallel PyTorch on mixed GPUs."""

from hsync._extension import _C
from hsync.ddp import WeightedDDP
from hsync.stats import StepStats

__all__ = ["StepStats", "WeightedDDP", "_C"]
__version__ = "0.1.0"
