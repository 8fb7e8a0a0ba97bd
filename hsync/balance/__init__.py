"""Balancing for mixed GPUs: per-rank batches planned from measured speed and memory, for any loop."""

from hsync.balance.balancer import BalanceConfig, Balancer
from hsync.balance.clock import StepClock
from hsync.balance.planner import RankCost, split_proportionally, split_step
from hsync.balance.reports import Report

__all__ = ["BalanceConfig", "Balancer", "RankCost", "Report", "StepClock", "split_proportionally", "split_step"]
