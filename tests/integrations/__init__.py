"""The integrations with the frameworks people train with, each run on real ranks."""

import torch


def assert_near_float32(params: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                        start: dict[str, torch.Tensor]) -> None:
    """`params`, of a run whose forwards ran in 16 bits, are float32 and lie within what that rounding allows of
    `exact`, a float32 run's: less than 2% of the distance `exact` moved from `start` (measured: about 0.2%)."""
    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return float(sum((a[name].detach().float() - b[name].detach().float()).norm() ** 2 for name in start) ** 0.5)

    assert all(value.dtype == torch.float32 for value in params.values())  # only the forward is 16-bit
    assert distance(params, exact) < 0.02 * distance(exact, start)
