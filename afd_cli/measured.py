"""What `afd serve` measures once for every process it starts.

Each process that multiplies on afd's AVX-512 BF16 path would otherwise measure for itself
from how many rows of x oneDNN's matmul takes over (afd/kernels/paths.py). Two measurements
on one box can land on different sides of a near tie, and a row's result is not the same bits
from the two matmuls: an FFN server restarted by the supervisor could then answer a layer
other than its predecessor did, and the same request could decode differently.
"""

from __future__ import annotations

import logging
import os

import torch

from afd.device import resolve
from afd.kernels import paths

log = logging.getLogger("afd.serve")


def children_env(devices: list[str], threads: int) -> dict[str, str]:
    """The environment every child gets on top of this process's: the crossover measured here
    with the children's thread count, where one of `devices` (the roles' device specs) is this
    CPU and the kernel path (AFD_KERNELS) is avx512bf16. Empty where the user set it already or
    nothing here reads it."""
    if paths.ROWS_ENV in os.environ:
        return {}
    if not any(resolve(d).type == "cpu" for d in devices):
        return {}
    if paths.active().matmul != "avx512bf16":
        return {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = paths.onednn_from_rows(threads)
    finally:
        torch.set_num_threads(before)
    value = str(0 if rows == paths.NEVER else rows)  # 0: never, as the variable reads it
    log.info("every process: %s=%s", paths.ROWS_ENV, value)
    return {paths.ROWS_ENV: value}
