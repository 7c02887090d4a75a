"""The fused routed-experts call (afd_bf16_moe in moe.c): one native call per layer for
all the experts a shard holds, where the torch path issues ~6 ops per expert."""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm

if TYPE_CHECKING:  # mxfp4.py and mlp.py import this module
    from afd.kernels.mlp import NativeMLP
    from afd.kernels.mxfp4 import FusedExperts

# an activation as the fused calls take it: (kind, limit, alpha), services/ffn/kinds.py's
# native_spec; ACTS: the kinds experts.h computes
ActSpec = tuple[str, float, float]
SWIGLU: ActSpec = ("swiglu", 0.0, 0.0)
ACTS = {"swiglu": 0, "swiglu_clamped": 1}


class NativeExperts:
    """The weight pointers of one layer's experts, kept beside the tensors that own them."""

    def __init__(
        self,
        w13: list[torch.Tensor] | list[BlockFP8],
        w2: list[torch.Tensor] | list[BlockFP8],
        isa: str,
        b13: list[torch.Tensor] | None = None,  # E x [2I], the experts' biases (gpt-oss)
        b2: list[torch.Tensor] | None = None,  # E x [H]
        act: ActSpec = SWIGLU,
    ):
        # w13: E x [2I, H], w2: E x [H, I], all bf16, contiguous (the tensors stay referenced),
        # laid out for isa's matmul (ops.Linear); or all block-FP8 with one block width, which
        # the call converts for isa's matmul as it goes (fp8_gemm.c)
        self.w13, self.w2, self.isa = w13, w2, isa
        self.count = len(w13)
        self.inter, self.hidden = w2[0].shape[1], w2[0].shape[0]
        ptrs = ctypes.c_void_p * self.count
        fp8 = isinstance(w13[0], BlockFP8)
        self.block_k = w13[0].block_k if fp8 else 0
        self._fp8 = (
            [
                ptrs(*(getattr(w, f).data_ptr() for w in ws))
                for ws in (w13, w2)
                for f in "q scale".split()
            ]
            if fp8
            else [None] * 4
        )  # w13's codes and scales, w2's: moe.c's q13, s13, q2, s2
        self._p13 = None if fp8 else ptrs(*(w.data_ptr() for w in w13))
        self._p2 = None if fp8 else ptrs(*(w.data_ptr() for w in w2))
        self._b13 = [b.to(torch.bfloat16).contiguous() for b in b13] if b13 else None
        self._b2 = [b.to(torch.bfloat16).contiguous() for b in b2] if b2 else None
        self._pb13 = ptrs(*(b.data_ptr() for b in self._b13)) if self._b13 else None
        self._pb2 = ptrs(*(b.data_ptr() for b in self._b2)) if self._b2 else None
        self.act = act
        # Successive calls visit the experts in alternating order. A layer's calls come back
        # to back with S >= 2 micro-batches (and M attention servers), and its expert weights
        # (~90 MB on the reference model) overflow the cache: the second call then starts on
        # the experts the first one ended with, still in L3, instead of reading them from DRAM.
        self._reverse = False

    def rebind(self, w13: list[torch.Tensor], w2: list[torch.Tensor], isa: str) -> NativeExperts:
        """The same call (biases, activation) on other weights of the same shapes, laid out for
        isa: the expert workspace's converted experts, which change from call to call."""
        other = copy.copy(self)
        ptrs = ctypes.c_void_p * self.count
        other.w13, other.w2, other.isa = w13, w2, isa
        other._p13 = ptrs(*(w.data_ptr() for w in w13))
        other._p2 = ptrs(*(w.data_ptr() for w in w2))
        return other

    @staticmethod
    def usable(w13: list, w2: list) -> bool:
        if not (w13 and gemm.available()):
            return False
        hidden, inter = w2[0].shape
        every = (*w13, *w2)
        if all(isinstance(w, BlockFP8) for w in every):
            dense = [t for w in every for t in (w.q, w.scale)]
            if len({w.block_k for w in every}) != 1:
                return False
        elif all(isinstance(w, torch.Tensor) for w in every):
            dense = every
            if not all(w.dtype == torch.bfloat16 for w in every):
                return False
        else:
            return False
        return (
            hidden % 8 == 0
            and inter % 8 == 0
            and all(t.is_contiguous() and t.device.type == "cpu" for t in dense)
            and all(tuple(w.shape) == (2 * inter, hidden) for w in w13)
            and all(tuple(w.shape) == (hidden, inter) for w in w2)
        )

    def __call__(
        self,
        x: torch.Tensor,  # [T, H] bf16
        expert_ids: torch.Tensor,  # [T, k] int: global ids as routed (other shards' skipped)
        expert_weights: torch.Tensor,  # [T, k] float: routing weights
        first: int,  # global id of this group's first expert
        out: torch.Tensor,  # [T, H] bf16, contiguous, accumulated into
    ) -> None:
        # per layer at batch 1 a no-op conversion's dispatch costs more than checking for it
        x = x if x.is_contiguous() else x.contiguous()
        ids = expert_ids
        if ids.dtype != torch.int32 or not ids.is_contiguous():
            ids = ids.to(torch.int32).contiguous()
        w = expert_weights
        if w.dtype != torch.float32 or not w.is_contiguous():
            w = w.float().contiguous()
        rc = gemm._lib().afd_bf16_moe_ext(
            x.data_ptr(),
            ids.data_ptr(),
            w.data_ptr(),
            ids.shape[1],
            first,
            self._p13,
            self._p2,
            out.data_ptr(),
            out.shape[0],
            self.count,
            self.hidden,
            self.inter,
            torch.get_num_threads(),
            self._reverse,
            gemm.ISAS[self.isa],
            self._pb13,
            self._pb2,
            ACTS[self.act[0]],
            self.act[1],
            self.act[2],
            *self._fp8,
            self.block_k,
        )
        self._reverse = not self._reverse
        if rc:
            raise RuntimeError("afd_bf16_moe failed (out of memory?)")


@dataclass(frozen=True)
class InlineExperts:
    """A layer's routed experts as an in-process caller may call them directly, in place of a
    message to the shard (afd/kernels/decode_stack.py): only where the shard's whole answer to
    that layer would be this one call (FFNEngine.inline_experts)."""

    native: NativeExperts | FusedExperts | None  # bf16, or MXFP4 multiplied as stored
    # (mxfp4.py); None: a dense layer, `shared` its MLP
    first: int  # global id of native's first expert
    rows_below: int  # the shard takes this call below this many rows per expert (else oneDNN)
    shared: NativeMLP | None = None  # the shared expert (mlp.py), where the layer has one
    shared_rows_below: int = 0  # the shard takes `shared` below this many rows (else oneDNN)
