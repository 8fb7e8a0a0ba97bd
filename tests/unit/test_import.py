"""`import hsync` leaves CUDA uninitialised, so that processes forked afterwards can still use it."""

import subprocess
import sys

# NVML reports one GPU; cudaGetDeviceCount, which would initialise the CUDA driver in this process
# (after which no forked child can use CUDA), records that it was called.
PROBE = """
import torch
called = []
torch.cuda._device_count_nvml = lambda: 1
torch._C._cuda_getDeviceCount = lambda: called.append(1) or 1
import hsync
print("driver initialised" if called else "driver untouched")
"""


def test_importing_hsync_does_not_initialise_the_cuda_driver():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # The forkserver of tests/spawn.py preloads hsync: were the driver initialised there, every rank
    # forked from it would fail at its first CUDA call.
    assert result.stdout.strip() == "driver untouched"


def test_importing_hsync_leaves_the_optional_frameworks_alone():
    # The integrations are extras: `import hsync` (and its integrations package) must work without them.
    probe = ("import sys, hsync, hsync.integrations; "
             "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
