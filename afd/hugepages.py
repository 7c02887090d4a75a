"""A service's loaded memory in 2 MiB pages (Linux transparent huge pages), in place.

A decode step streams every weight it needs from DRAM once. In 4 KiB pages that stream
crosses a page every 4 KiB: a TLB entry per page, a page walk per miss, and the hardware
prefetchers, which stop at page boundaries, start over at each one. Most distributions ship
THP in `madvise` mode, where no anonymous memory gets huge pages unless it asks, and torch's
allocator (and glibc's heap, which `runtime.tune_allocator` makes serve every tensor) never
asks. Once a service has loaded and laid out its weights, `back_loaded` asks the kernel to
move every fully populated 2 MiB run of the process's anonymous memory into huge pages
(MADV_COLLAPSE, Linux 6.1+): the virtual addresses stay, so the pointers that the native
kernels hold stay valid. Runs with a page never touched are left alone: collapsing them would
commit memory nobody uses (a thread's stack, say). The KV cache, zeroed at allocation, is
populated and moves with the weights.

Collapsing costs the kernel a copy and a TLB flush a page, and is slow where another thread of
the process is running (docs/benchmarks.md). A process that afd starts to load weights (`afd
serve`'s attention and FFN servers; the container image sets it for every process) gets
`child_env`'s glibc tunable instead: glibc's heap then asks for huge pages as it grows, the
weights are faulted in 2 MiB pages as they load, and `back_loaded` finds nothing left to move.

AFD_HUGE_PAGES=0 turns both off. Where the kernel cannot (THP `never`, an older kernel, not
Linux) it does nothing and logs why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("afd.hugepages")

ENV = "AFD_HUGE_PAGES"
HUGE = 2 << 20  # bytes in one huge page (x86-64's PMD size)
PAGE = 4096
_PER_HUGE = HUGE // PAGE
_SCAN = 1 << 30  # addresses whose pagemap entries are read at once
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
TUNABLE = "glibc.malloc.hugetlb"  # glibc 2.35+: 1 = madvise THP for the heap and its mmaps


@dataclass(frozen=True)
class Backed:
    """What one `back_loaded` did: bytes asked to move into huge pages, bytes that did, and the
    seconds it took; `reason` says why nothing was asked, where nothing was."""

    asked: int = 0
    moved: int = 0
    seconds: float = 0.0
    reason: str = ""


def enabled() -> str:
    """'' where this process may use huge pages; else the one-line reason it may not."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"{ENV}=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        with open(_THP) as f:
            mode = f.read()  # e.g. "always [madvise] never"
    except OSError:
        return "the kernel has no transparent huge pages"
    if "[never]" in mode:
        return "transparent huge pages are off on this host ([never])"
    return ""


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """GLIBC_TUNABLES for a child that will load weights, `environ`'s (this process's if None)
    with TUNABLE=1 added; {} where huge pages are off or the tunable is set already."""
    environ = os.environ if environ is None else environ
    have = environ.get("GLIBC_TUNABLES", "")
    if enabled() or TUNABLE in have:
        return {}
    return {"GLIBC_TUNABLES": ":".join(filter(None, (have, f"{TUNABLE}=1")))}


def anonymous_regions() -> list[tuple[int, int]]:
    """[start, end) of the process's private, writable, anonymous mappings (the heap included,
    the main thread's stack not): where torch's tensors live."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            name = parts[5] if len(parts) > 5 else ""
            if parts[1].startswith("rw") and parts[1][3] == "p" and name in ("", "[heap]"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def populated_runs(lo: int, hi: int, pagemap) -> list[tuple[int, int]]:
    """The runs of whole 2 MiB pages in [lo, hi) whose every 4 KiB page is resident, read from
    /proc/self/pagemap (one 64-bit entry per page; bit 63: present), a GiB of addresses at a
    time (a large reservation, mostly untouched, costs a bounded buffer)."""
    import torch  # here: afd serve's parent imports this module before any torch

    first, last = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
    runs: list[tuple[int, int]] = []
    for at in range(first, last, _SCAN):
        n = (min(at + _SCAN, last) - at) // PAGE
        raw = os.pread(pagemap, n * 8, at // PAGE * 8)
        if len(raw) < n * 8:
            break
        # bit 63 set reads as a negative int64
        entries = torch.frombuffer(bytearray(raw), dtype=torch.int64).view(-1, _PER_HUGE)
        for i, ok in enumerate((entries < 0).all(dim=1).tolist()):
            if not ok:
                continue
            start = at + i * HUGE
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + HUGE)
            else:
                runs.append((start, start + HUGE))
    return runs


def back_loaded() -> Backed:
    """Move the process's populated anonymous memory into huge pages (see the module); call it
    once a service has loaded its weights. Safe to call again: what moved stays moved."""
    reason = enabled()
    if reason:
        log.info("weights in 4 KiB pages: %s", reason)
        return Backed(reason=reason)
    libc = _libc()
    if libc is None:
        return Backed(reason="no C library to call madvise")
    t0 = time.perf_counter()
    try:  # a sandbox may hide /proc: then the memory stays as it is, the service goes on
        asked, moved, failed = collapse(anonymous_regions(), libc)
    except OSError as e:
        log.info("weights in 4 KiB pages: cannot read this process's memory map (%s)", e)
        return Backed(reason=f"cannot read /proc/self: {e}")
    seconds = time.perf_counter() - t0
    log.info(
        "%.2f of %.2f GiB of loaded memory in 2 MiB pages (%.2f s)%s",
        moved / 2**30, asked / 2**30, seconds, f"; the kernel said: {failed}" if failed else "",
    )  # fmt: skip
    return Backed(asked, moved, seconds)


def collapse(ranges: list[tuple[int, int]], libc) -> tuple[int, int, str]:
    """Ask for huge pages over the populated 2 MiB runs of `ranges` ([start, end) addresses)
    and collapse them now: (bytes asked, bytes moved, the kernel's last refusal or '').
    Raises OSError where /proc/self/pagemap cannot be read."""
    asked = moved = 0
    failed = ""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for lo, hi in ranges:
            for a, b in populated_runs(lo, hi, fd):
                asked += b - a
                libc.madvise(a, b - a, _MADV_HUGEPAGE)  # and so khugepaged keeps them huge
                if libc.madvise(a, b - a, _MADV_COLLAPSE) == 0:
                    moved += b - a
                else:
                    failed = os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return asked, moved, failed


def resident_huge() -> int:
    """Bytes of this process's memory in anonymous huge pages now (smaps_rollup)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
