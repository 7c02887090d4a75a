"""How the streaming matmuls share units among threads (afd/kernels/runs.h), replayed claim by
claim (runs.c): each thread takes its own run front to back, then the back of the run with the
most left; every unit goes out exactly once; with one run the units go out in order (OpenMP's
dynamic schedule)."""

from __future__ import annotations

import ctypes
import random

import pytest

from afd.kernels import gemm

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="kernel not built or the CPU lacks AVX2/FMA"
)


def replay(t: int, n: int, who: list[int]) -> list[int]:
    """The unit each claim gets (-1: none left); claim i made by thread who[i] of t runs."""
    lib = gemm._lib()
    f = lib.afd_runs_replay
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    claims = (ctypes.c_int32 * len(who))(*who)
    got = (ctypes.c_int32 * len(who))()
    assert f(t, n, ctypes.addressof(claims), len(who), ctypes.addressof(got)) == 0
    return list(got)


def test_each_thread_reads_its_own_run_front_to_back():
    assert replay(2, 10, [0, 1] * 5) == [0, 5, 1, 6, 2, 7, 3, 8, 4, 9]
    assert replay(3, 7, [0, 1, 2] * 3) == [0, 2, 4, 1, 3, 5, 6, -1, -1]


def test_a_thread_done_with_its_run_takes_the_back_of_the_longest_one():
    # thread 1 stalls (preempted): thread 0 finishes its run, then takes thread 1's from the back
    assert replay(2, 10, [0] * 11) == [0, 1, 2, 3, 4, 9, 8, 7, 6, 5, -1]
    # thread 1 meanwhile takes from the front what is left of its run
    assert replay(2, 10, [0] * 7 + [1, 1, 1, 0]) == [0, 1, 2, 3, 4, 9, 8, 5, 6, 7, -1]
    # of three runs the one with the most left is taken first
    assert replay(3, 9, [0, 0, 0, 1, 0, 0]) == [0, 1, 2, 3, 8, 5]


@pytest.mark.parametrize("t,n", [(1, 5), (2, 1), (2, 2), (2, 33), (4, 3), (5, 64), (8, 1000)])
def test_every_unit_goes_out_exactly_once_whoever_claims(t, n):
    rng = random.Random(t * 1000 + n)
    who = [rng.randrange(t) for _ in range(n + 3 * t)]
    got = replay(t, n, who)
    taken = [u for u in got if u >= 0]
    assert sorted(taken) == list(range(n))
    assert got[len(taken) :] == [-1] * (len(got) - len(taken))  # none is lost before the end


def test_one_run_hands_the_units_out_in_order():
    assert replay(1, 6, [0] * 7) == [0, 1, 2, 3, 4, 5, -1]
