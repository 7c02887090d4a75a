"""afd's kernels library (gemm.c, gemm512.c, moe.c, attention.c, norm_rope.c, decode_layer.c,
decode_stack.c, fp8.c, indexer.c, mxfp4.c, mxfp4_moe.c), found next to this file when the build
compiled it, and its bf16 matmuls: the AVX2 one on a packed weight (pack), the AVX-512 BF16 one
on the weight as it is.

`available()` is false where the library was not built (no compiler, not x86-64) or does not
load, or the CPU lacks AVX2/FMA; callers then use torch. Which kernels run is chosen in
afd/kernels/paths.py (AFD_KERNELS).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent


def _cpu_has_avx2_fma() -> bool:
    # ATen's own CPU dispatch level; its "AVX2" already requires FMA.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@cache
def _lib() -> ctypes.CDLL | None:
    if not _cpu_has_avx2_fma():
        return None
    found = sorted(_HERE.glob("_native*.so"))
    if not found:
        return None
    # torch is imported first, so the library's libgomp.so.1 resolves to torch's own OpenMP
    # runtime: one thread pool for both, not two fighting over the cores.
    try:
        lib = ctypes.CDLL(str(found[0]))
    except OSError:  # e.g. no libgomp.so.1 to be found: torch's matmul it is
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.afd_bf16_gemm.argtypes = [p, p, p, i, i, i, i]
    lib.afd_bf16_gemm.restype = i
    lib.afd_bf16_gemm512.argtypes = [p, p, p, i, i, i, i]
    lib.afd_bf16_gemm512.restype = i
    lib.afd_cpu_avx512bf16.argtypes = []
    lib.afd_cpu_avx512bf16.restype = i
    lib.afd_bf16_gemm_amx.argtypes = [p, p, p, i, i, i, i]
    lib.afd_bf16_gemm_amx.restype = i
    lib.afd_cpu_amx.argtypes = []
    lib.afd_cpu_amx.restype = i
    lib.afd_bf16_moe.argtypes = [p, p, p, i, i, p, p, p, i, i, i, i, i, i, i]
    lib.afd_bf16_moe.restype = i
    f = ctypes.c_float
    lib.afd_bf16_moe_ext.argtypes = [p, p, p, i, i, p, p, p] + [i] * 7 + [p, p, i, f, f]
    lib.afd_bf16_moe_ext.argtypes += [p, p, p, p, i]  # block-FP8 experts (or NULLs)
    lib.afd_bf16_moe_ext.restype = i
    lib.afd_bf16_decode_attention.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, i, f, i]
    lib.afd_bf16_decode_attention.restype = i
    ext = [p, p, p, p, p, p, i, i, i, i, i, i, i, i, f, p, i, i, i]
    lib.afd_bf16_decode_attention_ext.argtypes = ext
    lib.afd_bf16_decode_attention_ext.restype = i
    lib.afd_bf16_prefill_softmax.argtypes = [p, i, i, i, i, p, p, f, p, p, i, i]
    lib.afd_bf16_prefill_softmax.restype = i
    lib.afd_bf16_index_scores.argtypes = [p, p, p, p, i, p, i, i, i, i, i, i, f, i, i]
    lib.afd_bf16_index_scores.restype = i
    i64 = ctypes.c_int64
    lib.afd_topk_positions.argtypes = [p, i, i64, i, p, p, p, i]
    lib.afd_topk_positions.restype = i
    L = ctypes.c_long
    lib.afd_bf16_layer_norm.argtypes = [p, L, p, p, p, i, i, f]
    lib.afd_bf16_layer_norm.restype = i
    lib.afd_bf16_rms_norm.argtypes = [p, L, L, p, p, i, i, i, f, i, i]
    lib.afd_bf16_rms_norm.restype = i
    lib.afd_bf16_rope.argtypes = [p, L, p, i, i, i, p, p, p, i, i]
    lib.afd_bf16_rope.restype = i
    lib.afd_bf16_rope_heads.argtypes = [p, L, L, p, L, L, i, i, i, p, p, p, i, i]
    lib.afd_bf16_rope_heads.restype = i
    lib.afd_bf16_head_matmul.argtypes = [p, L, L, p, p, L, L, i, i, i, i, i, i]
    lib.afd_bf16_head_matmul.restype = i
    # the layer's weights (a ctypes Structure by reference), then the call's tensors and sizes
    lib.afd_bf16_mla_decode_layer.argtypes = [p] * 12 + [i] * 4 + [f, i, i, p, p, p]
    lib.afd_bf16_mla_decode_layer.restype = i
    lib.afd_bf16_mlp_add.argtypes = [p, p, p, p, i, i, i, i, f, f, i, i]
    lib.afd_bf16_mlp_add.restype = i
    lib.afd_bf16_mlp_add_ext.argtypes = lib.afd_bf16_mlp_add.argtypes + [p, p, p, p, i]
    lib.afd_bf16_mlp_add_ext.restype = i
    lib.afd_bf16_decode_layer.argtypes = [p] * 19 + [i] * 9 + [f, f, i, i, p, p, i, i, i, p, p]
    lib.afd_bf16_decode_layer.restype = i
    # gpt-oss's additions, then block-FP8 projections' codes and scales and their block
    layer_ext = lib.afd_bf16_decode_layer.argtypes + [p, p, p, i, p, i] + [p] * 6 + [i]
    lib.afd_bf16_decode_layer_ext.argtypes = layer_ext
    lib.afd_bf16_decode_layer_ext.restype = i
    stack = [p, i, p, p, p, p, p, p, p, p] + [i] * 13 + [f, i, i, p, p, p, p]
    stack += [p, p, p, p, p, L]  # the head, its logits and argmax; the tokens and the embedding
    lib.afd_bf16_decode_stack.argtypes = stack
    lib.afd_bf16_decode_stack.restype = i
    # the steps, how many ran; the stack's; each row's sampling and each step's uniforms
    lib.afd_bf16_decode_burst.argtypes = [i, p, *stack, p, p, p, p, p]
    lib.afd_bf16_decode_burst.restype = i
    lib.afd_apply_bitmask.argtypes = [p, p, i, i, p, i, i]
    lib.afd_apply_bitmask.restype = i
    lib.afd_argmax_rows.argtypes = [p, i, i, p, i]
    lib.afd_argmax_rows.restype = i
    lib.afd_sample_rows.argtypes = [p, i, i, p, p, p, p, p, p]
    lib.afd_sample_rows.restype = i
    lib.afd_act_rows.argtypes = [p, i, i, i, f, f, p]
    lib.afd_act_rows.restype = i
    lib.afd_topk_known.argtypes = [i, i]
    lib.afd_topk_known.restype = i
    lib.afd_topk_rows.argtypes = [p, i, i, i, p]
    lib.afd_topk_rows.restype = i
    lib.afd_topk_trust.argtypes = [i]
    lib.afd_topk_trust.restype = None
    lib.afd_fp8_quantize.argtypes = [p, p, p, i, i, i, i]
    lib.afd_fp8_quantize.restype = i
    lib.afd_fp8_dequantize.argtypes = [p, p, p, i, i, i, i]
    lib.afd_fp8_dequantize.restype = i
    lib.afd_fp8_gemm.argtypes = [p, p, p, p, i, i, i, i, i, i]
    lib.afd_fp8_gemm.restype = i
    lib.afd_mxfp4_to_bf16.argtypes = [p, p, p, i, i, i]
    lib.afd_mxfp4_to_bf16.restype = i
    lib.afd_mxfp4_linear.argtypes = [p, p, p, p, i, i, i, i, i, i]
    lib.afd_mxfp4_linear.restype = i
    lib.afd_mxfp4_moe.argtypes = [p, p, p, i, i] + [p] * 7 + [i] * 5 + [f, f, i, i]
    lib.afd_mxfp4_moe.restype = i
    return lib


def available() -> bool:
    return _lib() is not None


@cache
def avx512bf16() -> bool:
    """Whether the AVX-512 BF16 matmul runs here (the CPU and the OS support it)."""
    lib = _lib()
    return lib is not None and bool(lib.afd_cpu_avx512bf16())


@cache
def amx() -> bool:
    """Whether the AMX matmul runs here: the CPU has AMX tiles with BF16 and Linux granted this
    process the tile state (asked on the first call)."""
    lib = _lib()
    return lib is not None and bool(lib.afd_cpu_avx512bf16()) and bool(lib.afd_cpu_amx())


ISAS = {"avx2": 0, "avx512bf16": 1, "amx": 2}  # the kernels' isa argument (bf16.h's ISA_*)
K_MULTIPLE = {"avx2": 8, "avx512bf16": 2, "amx": 2}  # what each path's matmul needs of K


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 -> the layout every native matmul reads (bf16.h), same shape: each group
    of 4 rows as K/8 runs of 4 x 8 values, so a decode matmul streams it as one sequential
    run; the N % 4 rows after the last group stay as they are."""
    n, k = w.shape
    g = n // 4
    out = torch.empty((n, k), dtype=w.dtype)
    out[: 4 * g].view(g, k // 8, 4, 8).copy_(w[: 4 * g].reshape(g, 4, k // 8, 8).transpose(1, 2))
    out[4 * g :] = w[4 * g :]
    return out


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 -> the AMX matmul's layout (bf16.h: afd_amx_tiled), same shape: where N %
    16 == 0 and K % 32 == 0, each tile of 16 rows x 32 values as one run of 512, a group of 16
    rows' tiles in order of K; other shapes row-major (contiguous)."""
    n, k = w.shape
    if n % 16 or k % 32:
        return w.contiguous()
    return w.reshape(n // 16, 16, k // 32, 32).transpose(1, 2).contiguous().view(n, k)


def lay_out(w: torch.Tensor, isa: str) -> torch.Tensor:
    """W [N, K] bf16 as the matmul of path `isa` reads it: avx2 pack, amx pack_tiles,
    avx512bf16 row-major."""
    if isa == "avx2":
        return pack(w)
    return pack_tiles(w) if isa == "amx" else w.contiguous()


def matmul_io(x: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A native matmul's operands for x [..., K]: x as contiguous rows [M, K], M, and the bf16
    result [..., N] to fill."""
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2, x2.shape[0], torch.empty(x.shape[:-1] + (n,), dtype=torch.bfloat16)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, isa: str = "avx2") -> torch.Tensor:
    """x [..., K] bf16 @ W.T -> [..., N] bf16 for W [N, K] bf16 laid out for `isa` (lay_out):
    "avx2" needs K % 8 == 0; "avx512bf16" (where avx512bf16()) and "amx" (where amx()) an even
    K."""
    n, k = w.shape
    x2, m, y = matmul_io(x, n, k)
    lib = _lib()
    matmul = {"avx512bf16": lib.afd_bf16_gemm512, "amx": lib.afd_bf16_gemm_amx}.get(
        isa, lib.afd_bf16_gemm
    )
    if m and matmul(x2.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads()):
        raise RuntimeError(f"afd_bf16_gemm failed for x {tuple(x.shape)} @ w {tuple(w.shape)}")
    return y
