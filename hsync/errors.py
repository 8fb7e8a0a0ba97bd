"""How hsync names a bad value in its errors."""

from __future__ import annotations

import torch


def describe(value) -> str:
    """A tensor by its dtype and shape, anything else by its type and the start of its repr."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
