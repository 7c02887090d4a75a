"""One decode step's attention per layer, afd's native kernel against torch's path (the gather
and batched matmuls of services/attention/paged_attention.py), in one process.

    AFD_KERNELS=amx python scripts/bench_decode_attention.py --heads 16 32 64 128
    python scripts/bench_decode_attention.py --kv-heads 4 --heads 32 --dim 128  # GQA

The default shape is DeepSeek-V3's latent (D 576 = 512 + 64 of RoPE, V the leading 512,
one K/V head). Several layers' caches are read in turn so a layer's cache is not the one the
last call left in cache. Prints JSON: per head count, the medians (us a layer) and the ratio.
`--before LIB` also times another build's native library (an `_native*.so` from a worktree
of an earlier revision, same signatures) in the same rounds: a kernel change's effect
without the spread between processes. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_native import _load  # noqa: E402  (scripts/ is not a package)

from afd.kernels import attention, gemm, paths  # noqa: E402
from services.attention import paged_attention as pa  # noqa: E402


def _time(fn, layers: int, rounds: int) -> float:
    fn(0)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(layers):
            fn(i)
        samples.append((time.perf_counter() - t0) / layers * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=576, help="K's width")
    ap.add_argument("--v-dim", type=int, default=0, help="V's width (0: 512 of 576, else --dim)")
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", help="another build's _native*.so, timed in the same rounds")
    args = ap.parse_args()
    main_lib = gemm._lib()
    before_lib = None
    if args.before:  # loaded from a copy: the loader would hand back this checkout's library
        copy = Path(tempfile.mkdtemp(prefix="afd-bda-")) / "before.so"
        before_lib = _load(Path(args.before), main_lib, copy)
    D = args.dim
    Dv = args.v_dim or (512 if D == 576 else D)
    bs, kvh, B, L = 16, args.kv_heads, args.batch, args.positions
    nb = (L + bs - 1) // bs
    g = torch.Generator().manual_seed(0)
    caches, vs = [], []
    for _ in range(args.layers):
        k = torch.randn(kvh, B * nb, bs, D, generator=g).to(torch.bfloat16)
        caches.append(k)
        vs.append(k[..., :Dv] if Dv < D else torch.randn_like(k, dtype=torch.float32).bfloat16())
    # each sequence's blocks shuffled over the pool, as a served cache's are after a while
    blocks = torch.randperm(B * nb, generator=g).view(B, nb)
    lens = torch.full((B,), L, dtype=torch.long)
    bias = torch.zeros(B, 1, nb * bs)
    scale = D**-0.5
    rows = []
    for nh in args.heads:
        q = torch.randn(B, nh * kvh, D, generator=g).to(torch.bfloat16)

        def native(i: int, q=q) -> torch.Tensor:
            return attention.decode_attention(q, caches[i], vs[i], blocks, lens, scale)

        def reference(i: int, q=q) -> torch.Tensor:
            return pa._attend(q.unsqueeze(1), caches[i], vs[i], blocks, bias, scale)

        diff = (native(0).float() - reference(0).reshape(B, -1).float()).abs().max().item()
        a, b, c = [], [], []
        for _ in range(3):  # alternating
            a.append(_time(native, args.layers, args.rounds))
            b.append(_time(reference, args.layers, args.rounds))
            if before_lib is not None:
                gemm._lib = lambda: before_lib
                try:
                    c.append(_time(native, args.layers, args.rounds))
                finally:
                    gemm._lib = lambda: main_lib
        na, nt = statistics.median(a), statistics.median(b)
        row = {"query_heads_per_kv_head": nh, "native_us": round(na, 1), "torch_us": round(nt, 1),
               "torch_over_native": round(nt / na, 3), "max_abs_diff": diff}  # fmt: skip
        if c:
            nb_ = statistics.median(c)
            row |= {"before_us": round(nb_, 1), "before_over_native": round(nb_ / na, 3)}
        rows.append(row)
    print(json.dumps({"kernels": paths.active().name, "threads": torch.get_num_threads(),
                      "D": D, "Dv": Dv, "kv_heads": kvh, "batch": B, "positions": L,
                      "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
