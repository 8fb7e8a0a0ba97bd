"""Balancing for mixed GPUs: per-rank batches planned from measured speed and memory, for any loop."""

from hsync.balance.balancer import BalanceConfig, Balancer
from hsync.balance.planner import RankCost, split_proportionally, split_step
from hsync.balance.simulate import SimulatedSlowdown

__all__ = ["BalanceConfig", "Balancer", "RankCost", "SimulatedSlowdown", "split_proportionally", "split_step"]
