"""A decode step's layers in one native call (decode_stack.c): per layer the fused attention
layer (decode_layer.py; DeepSeek's MLA: mla_layer.py), the fused experts (moe.py; MXFP4
experts: mxfp4.py's FusedExperts), the shared expert where there is one (mlp.py) and the
residual add, for a process that holds both sides of the model. Block-FP8 projections and
experts go in as their own calls take them (codes, scales, K-block). The same calls with the
same roundings as the layer loop; what it saves is the Python around them."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import partial

import torch

from afd.blockfp8 import BlockFP8
from afd.kernels import gemm
from afd.kernels.decode_layer import NativeDecodeLayer
from afd.kernels.fp8_gemm import FP8Ref
from afd.kernels.mla_layer import NativeMLALayer
from afd.kernels.mlp import NativeMLP
from afd.kernels.moe import ACTS, NativeExperts
from afd.kernels.mxfp4 import FusedExperts
from afd.kernels.mxfp4 import isa as mxfp4_isa
from afd.kernels.sample import Draws

_POINTERS = (
    "attn_norm", "ffn_norm", "w_qkv", "q_norm", "k_norm", "inter_norm", "w_q", "w_o",
    "w_router", "cos", "sin", "k_cache", "v_cache", "w13", "w2",
)  # fmt: skip


# block-FP8 weights: the projections (decode_layer.py's w_qkv, w_q, w_o), the experts' codes
# and scales as per-expert arrays (moe.py's order), the shared expert's w13, w2
_FP8_ATTENTION = ("f8_qkv", "f8_q", "f8_o")
_FP8_EXPERTS = ("f8_q13", "f8_s13", "f8_q2", "f8_s2")
_FP8_SHARED = ("f8_sh13", "f8_sh2")


class StackLayer(ctypes.Structure):
    """decode_stack.c's afd_stack_layer: the same fields in the same order."""

    _fields_ = [(name, ctypes.c_void_p) for name in _POINTERS] + [
        ("experts", ctypes.c_int64),
        ("first", ctypes.c_int64),
        ("reverse", ctypes.c_int64),
        ("scale", ctypes.c_double),
        *((name, ctypes.c_void_p) for name in ("b_qkv", "b_o", "sinks", "router_bias")),
        ("window", ctypes.c_int64),
        ("route", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("b13", "b2", "mx_b13", "mx_s13", "mx_b2", "mx_s2")),
        ("act", ctypes.c_int64),
        ("limit", ctypes.c_double),
        ("alpha", ctypes.c_double),
        *((name, ctypes.c_void_p) for name in ("mla", "s13", "s2")),
        ("shared_inter", ctypes.c_int64),
        ("index_cache", ctypes.c_void_p),
        *((name, FP8Ref) for name in _FP8_ATTENTION),
        ("attn_bk", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in _FP8_EXPERTS),
        ("experts_bk", ctypes.c_int64),
        *((name, FP8Ref) for name in _FP8_SHARED),
        ("shared_bk", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class LayerParts:
    """What one layer of the stack is made of."""

    attention: NativeDecodeLayer | NativeMLALayer  # with its router and top-k (a dense layer:
    # neither)
    experts: NativeExperts | FusedExperts | None  # every routed expert (bf16 or MXFP4); None:
    # a dense layer, whose MLP is `shared`
    first: int  # the global id of experts' first
    k_cache: torch.Tensor  # [kvh, NB, bs, D] bf16, contiguous (MLA: the latent rows)
    v_cache: torch.Tensor  # (MLA: the latent's leading columns, a view of k_cache)
    cos: torch.Tensor  # [P, D] bf16
    sin: torch.Tensor
    scale: float  # the attention's softmax scale
    shared: NativeMLP | None = None  # the shared expert, added to the routed experts' sum
    # (a dense layer's MLP)
    index_cache: torch.Tensor | None = None  # [NB, bs, dim] bf16: a DSA layer's indexer keys


class _HeadStruct(ctypes.Structure):
    """decode_stack.c's afd_stack_head: the same fields in the same order."""

    _fields_ = [
        ("final_norm", ctypes.c_void_p),
        ("eps", ctypes.c_double),
        ("w", ctypes.c_void_p),
        ("f8", FP8Ref),
        ("bk", ctypes.c_int64),
        ("V", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class StackHead:
    """The model's LM head, for a call that ends at the model's last layer: logits =
    fp32(rms_norm(h, final_norm) @ weight^T), the weight bf16 laid out for the stack's matmuls
    or block-FP8 (its codes on the CPU, converted as the stack's isa multiplies them)."""

    final_norm: torch.Tensor  # [H] bf16, contiguous
    eps: float
    weight: torch.Tensor | BlockFP8  # [V, H], as ops.Linear holds it for the stack's isa

    def struct(self) -> _HeadStruct:
        """The C struct of this head; it points into the head's tensors."""
        fp8 = isinstance(self.weight, BlockFP8)
        return _HeadStruct(
            self.final_norm.data_ptr(), self.eps, None if fp8 else self.weight.data_ptr(),
            FP8Ref.of(self.weight), self.weight.block_k if fp8 else 0, self.weight.shape[0],
        )  # fmt: skip


@dataclass(frozen=True)
class StackResult:
    """What one call leaves. `done` layers ran (counted from the call's first); where done < L,
    layer `done`'s routing is left to the caller (a tie across its top-k cut) and h_attn, x,
    logits are that layer's. L: the layers the call was asked to run."""

    done: int
    h: torch.Tensor  # [T, H] bf16: the last layer's output, or layer `done`'s input
    h_attn: torch.Tensor  # [T, H]
    x: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, E] bf16
    ids: torch.Tensor  # [L, T, k] int32: the layers' routing (the first `done` are valid)
    weights: torch.Tensor  # [L, T, k] float32
    stamps: torch.Tensor  # [L, 3] float64: each layer's start, attention end, experts end
    head_logits: torch.Tensor | None = None  # [T, V] float32: the LM head's (asked, done == L)
    # [T] int64: each row's argmax of head_logits (after a burst, a sampled row's draw)
    head_argmax: torch.Tensor | None = None
    # a burst (steps > 1 asked): each step's chosen tokens [steps, T] int64 (a greedy row's
    # argmax, a sampled row's draw) and logits [steps, T, V] float32, the steps that ran to
    # their head; ids, weights [steps * L, T, k] and stamps [steps * L, 3] are then every
    # step's in turn, head_logits and head_argmax the last step's
    tokens: torch.Tensor | None = None
    step_logits: torch.Tensor | None = None


class NativeDecodeStack:
    """The layers' pointers, laid out once; the tensors stay referenced here."""

    def __init__(self, parts: list[LayerParts]):
        if not self.usable(parts):
            raise ValueError("these layers cannot run as one native decode stack")
        a = parts[0].attention
        moe = next(p for p in parts if p.experts is not None)
        self.parts = parts
        self.num_layers = len(parts)
        self.hidden, self.q_in, self.nh, self.kvh, self.d = a.hidden, a.q_in, a.nh, a.kvh, a.d
        self.eps, self.isa = a.eps, a.isa
        self.topk, self.norm = moe.attention.topk, moe.attention.norm_topk
        self.router_experts, self.inter = moe.attention.experts, moe.experts.inter
        self.dense = [p.experts is None for p in parts]  # their routing: ids -1
        self._layers = (StackLayer * len(parts))()
        for s, p in zip(self._layers, parts, strict=True):
            s.cos, s.sin = p.cos.data_ptr(), p.sin.data_ptr()
            s.k_cache, s.v_cache = p.k_cache.data_ptr(), p.v_cache.data_ptr()
            if isinstance(p.attention, NativeMLALayer):
                s.mla = ctypes.addressof(p.attention.layer)
                if p.index_cache is not None:
                    s.index_cache = p.index_cache.data_ptr()
            else:
                for name, v in zip(_POINTERS, p.attention._ptrs, strict=False):
                    setattr(s, name, v)  # the weights: the pointers before the caches'
                s.b_qkv, s.b_o, s.sinks, s.router_bias = p.attention._extra_ptrs
                s.window, s.route = p.attention.window, p.attention.route
                for name, w in zip(_FP8_ATTENTION, p.attention.fp8_weights, strict=True):
                    setattr(s, name, FP8Ref.of(w))
                s.attn_bk = p.attention.block_k
            s.scale = p.scale
            if p.shared is not None:
                s.s13, s.s2 = p.shared.ptrs
                for name, w in zip(_FP8_SHARED, (p.shared.w13, p.shared.w2), strict=True):
                    setattr(s, name, FP8Ref.of(w))
                s.shared_inter, s.shared_bk = p.shared.inter, p.shared.block_k
            e = p.experts
            if e is None:  # a dense layer: its MLP's activation
                s.experts, s.first = 0, 0
                s.act, s.limit, s.alpha = p.shared.act, p.shared.limit, p.shared.alpha
                continue
            s.experts, s.first = e.count, p.first
            if isinstance(e, FusedExperts):  # pointer arrays: blocks, scales, biases per side
                b13, s13, bias13, b2, s2, bias2 = (_address(a) for a in e._p)
                s.mx_b13, s.mx_s13, s.b13, s.mx_b2, s.mx_s2, s.b2 = b13, s13, bias13, b2, s2, bias2
            else:
                s.w13, s.w2 = _address(e._p13), _address(e._p2)
                s.b13, s.b2 = _address(e._pb13), _address(e._pb2)
                for name, ptrs in zip(_FP8_EXPERTS, e._fp8, strict=True):
                    setattr(s, name, _address(ptrs))
                s.experts_bk = e.block_k
            s.act, s.limit, s.alpha = _experts_act(e)

    @staticmethod
    def usable(parts: list[LayerParts]) -> bool:
        """One shape and kernel for every layer, routing in the call, caches as the call reads;
        dense layers (no router, their MLP native) among MoE ones."""
        moe = [p for p in parts if p.experts is not None]
        if not moe or not gemm.available():
            return False
        a0, e0, c0 = moe[0].attention, moe[0].experts, parts[0].k_cache
        same_attention = ("hidden", "q_in", "nh", "kvh", "d", "eps", "isa")
        for p in parts:
            a, e, sh = p.attention, p.experts, p.shared
            if any(getattr(a, f) != getattr(a0, f) for f in same_attention):
                return False
            if type(a) is not type(a0):  # one kind of attention: the call's sizes are its
                return False
            mla = isinstance(a, NativeMLALayer)
            for t in (p.k_cache,) if mla else (p.k_cache, p.v_cache):
                if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != c0.shape:
                    return False
            if mla and p.v_cache.data_ptr() != p.k_cache.data_ptr():
                return False  # MLA's V: the latent rows' leading columns
            if not _index_cache_fits(p):
                return False
            if sh is not None and (sh.isa != a.isa or sh.hidden != a.hidden):
                return False
            if e is None:  # a dense layer: no router in its call, its MLP native
                if a.experts or sh is None:
                    return False
                continue
            if (a.experts, a.topk, a.norm_topk) != (a0.experts, a0.topk, a0.norm_topk):
                return False
            if a.topk <= 0 or a.experts == 0:
                return False
            if (e.inter, e.hidden) != (e0.inter, e0.hidden) or e.hidden != a.hidden:
                return False
            if _experts_isa(e) != a.isa:  # the call passes one instruction set to both
                return False
            if p.first < 0 or p.first + e.count > a.experts:
                return False
            if sh is not None and (sh.act, sh.limit, sh.alpha) != _experts_act(e):
                return False  # the call applies the experts' activation to both
        return True

    def __call__(
        self,
        h: torch.Tensor | None,  # [T, H] bf16: the layers' input, T single-token decodes
        positions: torch.Tensor,  # [T] long
        slots: torch.Tensor,  # [T] long
        blocks: torch.Tensor,  # [T, nb] long
        lens: torch.Tensor,  # [T] long
        start: int = 0,  # the first of the stack's layers to run (after a tie, the next one)
        head: StackHead | None = None,  # the LM head too, where the call ends the model
        embed: tuple[torch.Tensor, torch.Tensor] | None = None,  # with h None: (tokens, table)
        steps: int = 1,  # > 1: a burst of steps (decode_stack.c: afd_bf16_decode_burst)
        draws: Draws | None = None,  # a burst's sampled rows (greedy where None)
    ) -> StackResult:
        """With h None, the call embeds first: h = table[tokens] (tokens [T] long, table
        [V, H] bf16 contiguous, the model's embedding), as F.embedding would. A burst embeds
        the tokens, runs every layer and the head each step, and needs blocks to cover each
        row's positions up to positions + steps - 1."""
        if not 0 <= start < self.num_layers:
            raise ValueError(f"start {start} is not one of the stack's {self.num_layers} layers")
        if steps > 1 and (start or head is None or h is not None):
            raise ValueError("a burst starts at the first layer from tokens and runs the head")
        if h is None:
            assert embed is not None, "no hidden state and no tokens to embed"
            tokens, table = embed
            tokens = tokens if tokens.dtype == torch.long else tokens.long()
            tokens, vocab = tokens.contiguous(), table.shape[0]
            h = torch.empty(tokens.shape[0], self.hidden, dtype=torch.bfloat16)
            embed_args = (tokens.data_ptr(), table.data_ptr(), vocab)
        else:
            h, tokens, vocab = h.contiguous().clone(), None, 0  # h: written in place
            embed_args = (None, None, 0)
        T, L, k = h.shape[0], self.num_layers - start, self.topk
        h_attn, x = torch.empty_like(h), torch.empty_like(h)
        logits = torch.empty(T, self.router_experts, dtype=torch.bfloat16)
        ids = torch.empty(steps * L, T, k, dtype=torch.int32)
        weights = torch.empty(steps * L, T, k, dtype=torch.float32)
        stamps = torch.zeros(steps * L, 3, dtype=torch.float64)
        blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
        _, NB, bs, _ = self.parts[0].k_cache.shape
        at = ctypes.c_int(0)
        layers = ctypes.addressof(self._layers) + start * ctypes.sizeof(StackLayer)
        V = head.weight.shape[0] if head is not None else 0
        out = torch.empty(steps, T, V, dtype=torch.float32) if head is not None else None
        argmax = torch.empty(steps, T, dtype=torch.long) if head is not None else None
        head_struct = head.struct() if head is not None else None
        head_args = (
            (ctypes.byref(head_struct), out.data_ptr(), argmax.data_ptr())
            if head is not None
            else (None, None, None)
        )  # fmt: skip
        ran_steps = ctypes.c_int(1)
        lib = gemm._lib()
        sampled = draws.args() if draws is not None else (None,) * 5
        call = (
            lib.afd_bf16_decode_stack if steps == 1
            else partial(lib.afd_bf16_decode_burst, steps, ctypes.byref(ran_steps))
        )  # fmt: skip
        tail = () if steps == 1 else sampled
        rc = call(
            layers, L, h.data_ptr(), h_attn.data_ptr(), x.data_ptr(), logits.data_ptr(),
            positions.data_ptr(), slots.data_ptr(), blocks.data_ptr(), lens.data_ptr(),
            T, self.hidden, self.q_in, self.nh, self.kvh, self.d, NB, bs, blocks.shape[1],
            self.router_experts, k, self.norm, self.inter, self.eps, torch.get_num_threads(),
            self.isa, ids.data_ptr(), weights.data_ptr(), stamps.data_ptr(), ctypes.byref(at),
            *head_args, *embed_args, *tail,
        )  # fmt: skip
        if rc == -4:
            bad = int(tokens[at.value]) if tokens is not None else -1
            raise IndexError(f"token id {bad} is not in the embedding's {vocab} rows")
        if rc == -1:
            raise RuntimeError(
                f"afd_bf16_decode_stack: layer {at.value}'s attention failed "
                f"(lengths {lens.tolist()})"
            )
        if rc == -2:
            raise ExpertsFailed(at.value)
        if rc == -3:
            raise torch.OutOfMemoryError(
                "afd_bf16_decode_stack: no memory for the LM head's buffers"
            )
        ran = rc == L
        if steps == 1:
            ok = ran and out is not None and argmax is not None
            return StackResult(
                rc, h, h_attn, x, logits, ids, weights, stamps,
                out[0] if ok else None, argmax[0] if ok else None,
            )  # fmt: skip
        if not ran:  # the first step's result, as a one-step call leaves it
            return StackResult(rc, h, h_attn, x, logits, ids[:L], weights[:L], stamps[:L])
        n = ran_steps.value  # the steps that ran, the first at least
        assert argmax is not None and out is not None
        return StackResult(
            rc, h, h_attn, x, logits, ids[: n * L], weights[: n * L], stamps[: n * L],
            out[n - 1], argmax[n - 1], argmax[:n], out[:n],
        )  # fmt: skip


def _index_cache_fits(p: LayerParts) -> bool:
    """A DSA layer (an indexed MLA call) has its indexer keys as the call reads them; no other
    layer has any."""
    a, ix = p.attention, p.index_cache
    if not (isinstance(a, NativeMLALayer) and a.indexed):
        return ix is None
    _, NB, bs, _ = p.k_cache.shape
    return (
        ix is not None
        and ix.dtype == torch.bfloat16
        and ix.is_contiguous()
        and tuple(ix.shape) == (NB, bs, a.index_dim)
    )


def _address(ptrs) -> int | None:
    """A ctypes pointer array's address (None for None), as the layer struct holds it."""
    return None if ptrs is None else ctypes.addressof(ptrs)


def _experts_act(e: NativeExperts | FusedExperts) -> tuple[int, float, float]:
    """The activation (moe.c's kind, limit, alpha) the stack passes for the layer's experts."""
    if isinstance(e, FusedExperts):
        return e.act, e.limit, e.alpha
    return ACTS[e.act[0]], e.act[1], e.act[2]


def _experts_isa(e: NativeExperts | FusedExperts) -> int:
    """The instruction set the experts' own call would pass (moe.py, mxfp4.py)."""
    if isinstance(e, FusedExperts):
        return mxfp4_isa(e.foldable)
    return gemm.ISAS[e.isa]


class ExpertsFailed(RuntimeError):
    """The fused experts of a layer failed inside the stack (memory short)."""

    def __init__(self, layer: int):
        super().__init__(f"the fused experts of layer {layer} failed (out of memory?)")
        self.layer = layer
