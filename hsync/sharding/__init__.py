"""Memory-proportional sharding: each rank keeps the optimizer state of the parameters it owns."""

from hsync.sharding.optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
