"""Process-wide tuning applied once by every service."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("afd.runtime")

T = TypeVar("T")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def tune_allocator() -> bool:
    """Keep freed memory in glibc's heap instead of returning it to the OS.

    Every decode step allocates the same large temporaries (gathered K/V, activations). By
    default glibc serves blocks over 128 KiB-32 MiB with mmap and unmaps them on free, so each
    step page-faults all of them in again, and for a large gather the faults cost more than the
    copy itself (docs/benchmarks.md). Returns whether the setting took effect (glibc only).
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt not honoured; large temporaries will be re-faulted each step")
    return ok


def release_load_memory() -> bool:
    """Give the OS back what loading freed (the read originals of weights since concatenated,
    converted or re-laid out), once: `tune_allocator` keeps freed memory for the per-step
    temporaries, which would otherwise hold a load's garbage resident for good. glibc only;
    returns whether it ran."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def freeze_startup_heap() -> None:
    """Exempt everything alive at the end of start-up (imported modules, loaded weights' Python
    objects) from the garbage collector, just before a service starts serving.

    A service process holds a few hundred thousand such objects (torch and the services are
    imported by every `afd` command). Left to the collector, each full collection walks them
    all, a pause of tens to over a hundred milliseconds that lands on whichever request or
    step is in flight (a test saw the gateway's time to first token at the client exceed the
    gateway's own by ~120 ms on the first requests). Frozen, they are never walked again;
    what requests allocate is collected as before.
    """
    gc.collect()
    gc.freeze()


def on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a thread that ends when it returns: for building what a service
    then computes with on another thread (an engine, its weights laid out, its kernels
    measured), so that the OpenMP workers the build used go with it.

    libgomp gives every thread that starts a parallel region a pool of workers, kept until that
    thread ends. With more workers than cores (the loading thread's pool beside the compute
    thread's), libgomp caps spinning at its barriers and its workers sleep instead: a decode
    step, dozens of short parallel regions, then waits on a wake-up at each one (measured in
    docs/benchmarks.md, "One OpenMP pool per process"). fn's exception, if any, is raised
    here."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            out.append((False, e))

    t = threading.Thread(target=run, name=f"build:{getattr(fn, '__name__', 'fn')}", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
