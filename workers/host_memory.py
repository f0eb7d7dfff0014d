"""Keep freed host memory in the process: glibc's ``malloc`` hands blocks of 128 KiB and up straight to the
kernel (``mmap``) and gives them back on ``free`` (``munmap``, and heap trimming). A verify step's
full-vocabulary temporaries (one [b, L, V] float32 block per pass: 6 MiB at two requests x L 5 x
V 152k) were fresh pages on every pass, each page faulted in and zeroed by the kernel: measured on the
2-core CPU machine, ~1.1 million page faults and ~2.7 s of kernel time per B = 256 KL-judge step, half
its wall time. :func:`keep_freed_memory` raises glibc's mmap threshold to its maximum (32 MiB) and its
trim threshold to 1 GiB, so such blocks come from the heap and stay there for the next pass (the process
keeps its peak working memory, which it reuses). The same as ``MALLOC_MMAP_THRESHOLD_=33554432
MALLOC_TRIM_THRESHOLD_=1073741824`` in the environment, applied where spectune's rules run: the vLLM
plugin's processes, the CPU engine, the step benchmark and the GPU check. A no-op off glibc."""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the two thresholds once per process; True where glibc took them."""
    global _applied
    if _applied is None:
        _applied = False
        if sys.platform.startswith("linux"):
            try:
                mallopt = ctypes.CDLL("libc.so.6").mallopt
                _applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            except (OSError, AttributeError):  # not glibc (musl has no mallopt)
                _applied = False
    return _applied
