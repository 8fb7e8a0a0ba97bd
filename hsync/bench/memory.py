"""What a training step keeps alive, measured: the caching allocator on a GPU, malloc and the profiler on the CPU."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from functools import cache

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def live_bytes(device: torch.device) -> int:
    """Bytes of live tensors on `device`; on the CPU, every byte malloc has handed out, on every thread
    (glibc's mallinfo2: torch's CPU tensors come from malloc)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


@cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    """glibc's mallinfo2, looked up once; None elsewhere (macOS, musl), where CPU memory goes unmeasured."""
    function = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if function is not None:
        function.restype = _Mallinfo2
    return function


def peak_bytes_during(fn: Callable[[], None], device: torch.device) -> int:
    """Runs fn(); returns the peak bytes of tensors on `device` during it over those alive before."""
    if device.type == "cuda":
        start = live_bytes(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    # The profiler records each allocation and free through torch's CPU allocator on the threads it
    # follows (this one and autograd's). Within steps every transient is made and freed there; what
    # the communicators' threads hold lives across steps and is counted by live_bytes instead.
    gc.collect()  # garbage of earlier work freed inside fn would count against it
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def measurable(device: torch.device) -> bool:
    """Whether live_bytes and peak_bytes_during can measure `device` here."""
    return device.type == "cuda" or _mallinfo2() is not None
