"""Loaded memory moves into 2 MiB pages in place (afd/hugepages.py); untouched memory stays
uncommitted; AFD_HUGE_PAGES=0 turns it off."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import subprocess
import sys

import pytest

from afd import hugepages

SIZE = 16 << 20


def _kernel_collapses() -> str:
    """'' where this host can collapse anonymous memory (Linux 6.1+, THP not off)."""
    reason = hugepages.enabled()
    if reason:
        return reason
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return "" if (major, minor) >= (6, 1) else f"kernel {os.uname().release} has no MADV_COLLAPSE"


pytestmark = pytest.mark.skipif(bool(_kernel_collapses()), reason=_kernel_collapses() or "-")


def _region(touch_every: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, SIZE, touch_every):
        m[off : off + 8] = (off // touch_every).to_bytes(8, "little")
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _smaps(addr: int) -> dict[str, int]:
    """The kB counters of the mapping that holds addr."""
    found, out = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                if found:
                    break
                found = int(head[1], 16) <= addr < int(head[2], 16)
            elif found and line.split()[-1] == "kB":
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def test_populated_memory_moves_into_huge_pages_with_its_contents():
    m, addr = _region(touch_every=4096)
    assert _smaps(addr)["AnonHugePages"] == 0  # madvise mode: nothing asked yet
    done = hugepages.back_loaded()
    assert done.moved >= SIZE - 2 * hugepages.HUGE and not done.reason
    assert _smaps(addr)["AnonHugePages"] * 1024 >= SIZE - 2 * hugepages.HUGE
    assert all(int.from_bytes(m[o : o + 8], "little") == o // 4096 for o in range(0, SIZE, 4096))
    m.close()


def test_untouched_pages_are_not_committed():
    m, addr = _region(touch_every=hugepages.HUGE)  # one 4 KiB page of each 2 MiB
    before = _smaps(addr)["Rss"]
    hugepages.back_loaded()
    after = _smaps(addr)
    assert after["AnonHugePages"] == 0 and after["Rss"] == before
    m.close()


def test_switched_off(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    m, addr = _region(touch_every=4096)
    done = hugepages.back_loaded()
    assert done.reason == "AFD_HUGE_PAGES=0" and done.moved == 0
    assert _smaps(addr)["AnonHugePages"] == 0
    m.close()


def test_a_child_that_loads_weights_asks_glibc_for_huge_pages():
    assert hugepages.child_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    kept = hugepages.child_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert kept == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert hugepages.child_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}  # the user's


def test_a_child_loads_its_memory_in_huge_pages(tmp_path):
    """What the tunable buys: a child's populated heap is in huge pages before any collapse."""
    script = (
        "import torch; from afd import hugepages; x = torch.ones(64 << 20);"
        "print(hugepages.resident_huge())"
    )
    env = {**os.environ, **hugepages.child_env()}
    env.pop(hugepages.ENV, None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert int(out.stdout.strip()) >= (256 << 20) - 2 * hugepages.HUGE, out.stderr


def test_runs_read_in_pieces_join_up(monkeypatch):
    """The pagemap is read a piece of the address space at a time; a populated run that spans
    pieces comes back as one."""
    m, addr = _region(touch_every=4096)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        whole = hugepages.populated_runs(addr, addr + SIZE, fd)
        monkeypatch.setattr(hugepages, "_SCAN", 2 * hugepages.HUGE)
        pieces = hugepages.populated_runs(addr, addr + SIZE, fd)
    finally:
        os.close(fd)
    assert pieces == whole and len(whole) == 1
    assert whole[0][1] - whole[0][0] >= SIZE - 2 * hugepages.HUGE
    m.close()


def test_a_hidden_proc_leaves_the_memory_as_it_is(monkeypatch):
    """Where the memory map cannot be read (a sandbox), nothing moves and the caller goes on."""
    real = os.open

    def refused(path, *a, **k):
        if str(path).startswith("/proc/self/pagemap"):
            raise PermissionError(13, "Permission denied", path)
        return real(path, *a, **k)

    monkeypatch.setattr(hugepages.os, "open", refused)
    done = hugepages.back_loaded()
    assert done.moved == 0 and "cannot read /proc/self" in done.reason
