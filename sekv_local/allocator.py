"""What the process holds: glibc allocator settings that give freed tensors back, and resident-memory readers.

A cache method frees and reallocates large tensors at every chunk (attention blocks, rebuilt rows). With
glibc's defaults, the threshold above which an allocation gets its own mapping rises to 32 MiB after the
first large free, so most tensors land on the heap, and a freed block in the middle of it stays resident:
a 7K-token read then held 1.2-1.6x full KV's bytes that no method had asked for. Serving every allocation
of 4 MiB or more from its own mapping, and trimming the heap's top, gives them back.

MKL (inside torch's CPU build) keeps the buffers of its matrix products in a pool of its own: 34 MiB in 6
buffers after a 3K-token read with StreamingLLM, 6-7 MiB more than before the read, which no method reports and
no trim reaches. Turning the pool off (MKL_DISABLE_FAST_MM) made a 7K-token read 1.16-1.19x slower, so the pool
stays on while the model computes and is emptied when a read or an answer is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import lru_cache
from typing import Callable

#: allocations from this size on get their own mapping and go back to the OS when freed; smaller ones (attention
#: blocks, per-step rows) are reused from the heap: mapping each anew cost more time in page faults than compute
MMAP_THRESHOLD_BYTES = 4 << 20
#: free memory at the heap's top beyond this goes back to the OS at once
TRIM_THRESHOLD_BYTES = 8 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc malloc.h)
_M_MMAP_THRESHOLD = -3


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@lru_cache(maxsize=1)
def _mkl_free_buffers() -> Callable[[], None] | None:
    """MKL's `mkl_free_buffers` as torch's CPU library exports it (None where that build has no MKL)."""
    torch = sys.modules["torch"]  # looked up once torch is imported: before, there is no pool to empty
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        free = lib.mkl_serv_free_buffers
    except (OSError, AttributeError):  # another torch build (no MKL, or not Linux)
        return None
    free.restype = None
    return free


def release_compute_pools() -> None:
    """Empty MKL's buffer pool, then give free heap pages back (:func:`release_free_memory`). For the end of a
    read or of an answer: emptied after every chunk, the pool would be refilled at the next one."""
    if "torch" in sys.modules:
        free = _mkl_free_buffers()
        if free is not None:
            free()
    release_free_memory()


def release_free_memory() -> None:
    """Give the pages of free heap blocks back to the OS (glibc's malloc_trim; a few ms). Called after each
    chunk a model reads: the blocks its layers freed lie between live ones, where trimming the top alone
    cannot reach them (at 3K tokens they were 86 MiB, more than the whole SeKV cache)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


@lru_cache(maxsize=1)
def give_back_freed_memory() -> bool:
    """Set glibc's allocator to return freed large blocks (once per process; False where libc is not glibc).
    Environment settings (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) are overridden."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def resident_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes (Linux /proc; (0, 0) elsewhere)."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values["VmRSS"], values["VmHWM"]


def reset_peak() -> bool:
    """Start the peak resident size afresh from the current one (Linux: /proc/self/clear_refs, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
