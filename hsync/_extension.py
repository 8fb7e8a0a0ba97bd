"""Loads the compiled core and refuses to run without it rather than falling back silently."""

import torch

_REBUILD = "rebuild it from the repository root with: pip install --no-build-isolation -e ."

try:
    from hsync import _C
except ImportError as error:
    raise ImportError(f"hsync's compiled extension hsync._C could not be loaded ({error}); {_REBUILD}") from error

# device_count() asks NVML; is_available() would initialise the CUDA driver in this process, and a
# process forked from it afterwards (a forkserver that preloads hsync, a fork-started worker) could
# then not use CUDA at all.
if torch.cuda.device_count() > 0 and not _C.cuda_enabled:
    raise ImportError(
        "this machine has a CUDA device but hsync._C was built without CUDA and NCCL (no CUDA toolkit "
        f"was found at build time); install the toolkit or set CUDA_HOME, then {_REBUILD}"
    )

__all__ = ["_C"]
