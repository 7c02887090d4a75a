"""Which kernels carry the bf16 compute: the registry of kernel paths and the one switch that
picks one, AFD_KERNELS=auto|amx|avx512bf16|avx2|onednn|torch.

- amx: afd's kernels with every matmul on AMX tiles (amx.c: TDPBF16PS, 16 x 32 by 32 x 16 bf16
  per instruction) on weights re-laid out once in tiles (gemm.pack_tiles), at every batch size
  (it beats oneDNN's matmul at each size measured, and a row's result is then the same bits at
  every batch size); the rest as avx512bf16. Intel Sapphire Rapids and later.
- avx512bf16: afd's kernels (gemm512.c: vdpbf16ps) on the weights as loaded, for the batches
  where they beat oneDNN; oneDNN's matmul (torch's F.linear) on the same weights above that
  (onednn_from_rows, measured here once); afd's fused layer, experts, attention, norms, RoPE.
- avx2: afd's AVX2 kernels for every matmul, on weights re-laid out once (gemm.pack), and the
  same fused kernels. The only fast bf16 path on CPUs without AVX-512 (Zen 3).
- onednn: every matmul through oneDNN on weights it re-lays out once; the rest in torch.
- torch: torch alone (F.linear and its ops), the reference path.

`auto` takes the first runnable of amx, avx512bf16, avx2, onednn, torch and logs the choice. A
model's weights are laid out for the path active when it is loaded (ops.Linear), so a process
runs one path; `use` switches it for what is built inside (tests, benchmarks).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from afd.errors import ConfigError
from afd.kernels import gemm

log = logging.getLogger("afd.kernels")

ENV = "AFD_KERNELS"


@cache
def onednn_bf16() -> bool:
    """Whether oneDNN can pack a bf16 weight here. It needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT:
    on an AVX2-only CPU (e.g. Zen 3) the reorder raises, so try it once, tiny."""
    try:
        if not (
            torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        ):
            return False
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=torch.bfloat16), 1)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 16, dtype=torch.bfloat16), w, None, "none", [], ""
        )
        return bool((y == 16).all())
    except Exception:  # builds without oneDNN, or a CPU it has no bf16 path for
        return False


@dataclass(frozen=True)
class KernelPath:
    name: str
    matmul: str  # who multiplies: "amx", "avx512bf16", "avx2" (afd's kernels), "onednn", "torch"
    native: bool  # afd's fused layer, fused experts, paged attention, norms and RoPE run
    runnable: Callable[[], bool]


PATHS: dict[str, KernelPath] = {
    p.name: p
    for p in (
        KernelPath("amx", "amx", True, gemm.amx),
        KernelPath("avx512bf16", "avx512bf16", True, gemm.avx512bf16),
        KernelPath("avx2", "avx2", True, gemm.available),
        KernelPath("onednn", "onednn", False, onednn_bf16),
        KernelPath("torch", "torch", False, lambda: True),
    )
}


def runnable() -> tuple[str, ...]:
    """The paths this machine executes, fastest first."""
    return tuple(name for name, p in PATHS.items() if p.runnable())


def resolve(name: str) -> KernelPath:
    """A path by name ("auto": the first runnable); a ConfigError names what is wrong."""
    if name == "auto":
        return PATHS[runnable()[0]]
    if name not in PATHS:
        raise ConfigError(f"{ENV}={name!r}: expected auto or one of {', '.join(PATHS)}")
    if not PATHS[name].runnable():
        raise ConfigError(
            f"{ENV}={name}: this machine cannot run it (runnable: {', '.join(runnable())})"
        )
    return PATHS[name]


_active: KernelPath | None = None


def active() -> KernelPath:
    """The path of this process: AFD_KERNELS (auto when unset), resolved once and logged."""
    global _active
    if _active is None:
        asked = os.environ.get(ENV, "auto").strip() or "auto"
        _active = resolve(asked)
        here = ", ".join(runnable())
        log.info("kernels: %s (%s=%s; runnable here: %s)", _active.name, ENV, asked, here)
    return _active


def isa() -> int:
    """The isa argument of afd's kernels for the active path (gemm.ISAS): its instruction set
    for the small kernels (attention, norms, RoPE, the FP8 codec) too; oneDNN's and torch's
    paths take the AVX2 code, which every CPU that loads the library runs."""
    return gemm.ISAS.get(active().matmul, 0)


@contextmanager
def use(name: str) -> Iterator[KernelPath]:
    """Run what is built and called inside on path `name` (tests, benchmarks)."""
    global _active
    before, _active = _active, resolve(name)
    try:
        yield _active
    finally:
        _active = before


NEVER = 1 << 30
ROWS_ENV = "AFD_ONEDNN_FROM_ROWS"

# oneDNN takes a row count over only where it is this much faster: near a tie afd's kernel
# keeps it, since the fused decode layer built on it (which oneDNN cannot join) saves more
MARGIN = 1.05


def onednn_from_rows(threads: int) -> int:
    """From how many rows of x oneDNN's matmul beats afd's AVX-512 BF16 kernel on this machine
    (NEVER: it does not), measured once per thread count: where oneDNN has AMX it wins from a
    handful of rows, where it has only AVX-512 much later. The environment's
    AFD_ONEDNN_FROM_ROWS (0: never) overrides the measurement: `afd serve` measures once and
    hands every process it starts the same number, so they all multiply alike."""
    forced = os.environ.get(ROWS_ENV, "").strip()
    if forced:
        try:
            return int(forced) or NEVER
        except ValueError:
            raise ConfigError(f"{ROWS_ENV}={forced!r}: expected a number") from None
    return _measured_crossover(threads)


def _weights_past_cache() -> list[torch.Tensor]:
    """[1024, 1024] bf16 weights, twice the last-level cache in all (64-256 MiB): cycled, each is
    read from DRAM, as a decode step reads its model's. On one weight in cache both matmuls are
    bound by their arithmetic, and oneDNN's wins from fewer rows than it does from DRAM
    (docs/benchmarks.md, Zen 4)."""
    llc = 32 << 20
    try:
        base = "/sys/devices/system/cpu/cpu0/cache"
        for idx in sorted(os.listdir(base)):
            with open(f"{base}/{idx}/level") as f, open(f"{base}/{idx}/size") as g:
                if f.read().strip() == "3":
                    size = g.read().strip()
                    llc = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
    except (OSError, ValueError):
        pass
    count = min(max(2 * llc, 64 << 20), 256 << 20) // (2 << 20)
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return [w.clone() for _ in range(count)]


def _alternating_medians(a: Callable[[], object], b: Callable[[], object], rounds: int = 5):
    """Median seconds of a and of b, run in turn (a box's speed drifts within seconds)."""
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(rounds):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


@cache
def _measured_crossover(threads: int) -> int:
    if not (gemm.avx512bf16() and onednn_bf16()):
        return NEVER
    ws = _weights_past_cache()
    g = torch.Generator().manual_seed(1)
    for m in (2, 4, 8, 16, 32, 64, 128, 256):
        x = torch.randn(m, 1024, generator=g).to(torch.bfloat16)
        ours, theirs = _alternating_medians(
            lambda x=x: [gemm.bf16_linear(x, w, "avx512bf16") for w in ws],
            lambda x=x: [F.linear(x, w) for w in ws],
        )
        if ours > theirs * MARGIN:
            log.info("kernels: oneDNN's matmul from %d rows of x (%d threads)", m, threads)
            return m
    log.info("kernels: afd's matmul at every batch size (%d threads)", threads)
    return NEVER
