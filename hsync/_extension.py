"""Loads the compiled core and refuses to run without it rather than falling back silently."""

import torch

_REBUILD = "rebuild it from the repository root with: pip install --no-build-isolation -e ."

try:
    from hsync import _C
except ImportError as error:
    raise ImportError(f"hsync's compiled extension hsync._C could not be loaded ({error}); {_REBUILD}") from error

if torch.cuda.is_available() and not _C.cuda_enabled:
    raise ImportError(
        "this machine has a CUDA device but hsync._C was built without CUDA and NCCL (no CUDA toolkit "
        f"was found at build time); install the toolkit or set CUDA_HOME, then {_REBUILD}"
    )

__all__ = ["_C"]
