"""Router top-k with torch.topk's tie-breaking, in the fused decode calls (topk.c).

The fused attention layer routes each token itself (decode_layer.c). Where a token's k-th
score equals one left out, which expert torch.topk keeps depends on how its CPU kernel moves
equal elements; topk.c replays that kernel's steps. Until `trust()` has checked, on rows full
of ties, that the replay picks what this process's torch picks, the native calls hand a tied
layer back to torch (stack.py), which at batch 32 broke the native decode stack at about half
of a step's layers."""

from __future__ import annotations

import logging
from functools import cache

import torch

from afd.kernels import gemm

log = logging.getLogger("afd.kernels")

# (experts, k) the check covers: the router shapes of the families afd serves, and more
# (the last four: std::partial_sort's path, k * 64 <= E)
_SHAPES = (
    (8, 2), (16, 4), (32, 4), (32, 8), (60, 4), (64, 6), (128, 8), (256, 8), (40, 17),
    (64, 1), (128, 2), (256, 4), (1152, 17),
)  # fmt: skip


def known(experts: int, k: int) -> bool:
    """Whether topk.c follows torch's path for this shape (else ties stay torch's)."""
    lib = gemm._lib()
    return lib is not None and bool(lib.afd_topk_known(experts, k))


def rows(x: torch.Tensor, k: int) -> torch.Tensor:  # [B, k] int32
    """topk.c's picks for x [B, E] float32 (contiguous), largest first."""
    B, E = x.shape
    ids = torch.empty(B, k, dtype=torch.int32)
    x = x.contiguous()
    if gemm._lib().afd_topk_rows(x.data_ptr(), B, E, k, ids.data_ptr()):
        raise ValueError(f"topk.c does not follow torch for {E} experts, top-{k}")
    return ids


@cache
def trust() -> bool:
    """Check topk.c against torch.topk on rows of few distinct values (ties everywhere) and,
    where they agree, let the native calls route tied tokens themselves. Once per process."""
    lib = gemm._lib()
    if lib is None:
        return False
    g = torch.Generator().manual_seed(0)
    for E, k in _SHAPES:
        if not known(E, k):
            continue
        x = torch.randint(0, 5, (512, E), generator=g).float() / 4
        want = torch.topk(x, k, dim=-1).indices.to(torch.int32)
        if not torch.equal(rows(x, k), want):
            log.info("router top-k: ties left to torch (its tie-breaking differs from topk.c's)")
            return False
    set_trusted(True)
    return True


def set_trusted(on: bool) -> None:
    """Let the native calls route tied tokens themselves (on) or hand them to torch (off);
    trust() turns it on after its check, the tests both ways."""
    lib = gemm._lib()
    if lib is not None:
        lib.afd_topk_trust(int(on))
