"""Data-plane micro-benchmark: the FP8 codec, the per-layer round trip, bytes on the wire.

    afd bench wire [--tokens 128 --hidden 7168 --transport tcp]

(a) quantize/dequantize time for one [T, H] micro-batch (and PyTorch's plain casts beside them);
(b) the per-layer round trip A2F + F2A to an FFN server in another process that answers with a
    ready [T, H] bf16 tensor: transport only (pre-quantized input) and with the FP8 codec on both
    sides, next to an in-memory copy (torch clone) of the same bytes;
(c) bytes on the wire per token per layer, FP8 vs BF16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from afd.messages import FFNReply, FFNRequest
from afd.quant import FP8, dequantize_fp8, quantize_fp8
from afd.transport import connect
from afd.wire import encode_reply, encode_request

# The FFN side: replies with a preallocated output, so only the transport is measured. A
# request with micro_batch == 1 also pays the receiver's share of the codec (dequantize).
_SERVER = """
import sys, torch
from afd.quant import dequantize_fp8
from afd.transport import FFNServing, listen
from afd.wire import WireLimits

torch.set_num_threads(int(sys.argv[4]))
T, H = int(sys.argv[2]), int(sys.argv[3])
out = torch.zeros(T, H, dtype=torch.bfloat16)

def compute(layer, reqs):
    for r in reqs:
        if r.micro_batch == 1 and r.scales is not None:
            dequantize_fp8(r.hidden, r.scales)
    return [out[: r.num_tokens] for r in reqs]

limits = WireLimits(hidden_size=H, num_layers=1, num_experts=256, max_tokens=T, top_k=16)
listener = listen(sys.argv[1], FFNServing(compute, limits))
print("READY", listener.address, flush=True)
sys.stdin.read()
listener.close()
"""


def _stats(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 4),
    }


def _time(fn: Callable[[], object], iters: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _stats(times)


def _codec(x: torch.Tensor, iters: int, warmup: int) -> dict:
    q, scales = quantize_fp8(x)

    def torch_cast_quantize():
        s = x.float().abs().amax(dim=1, keepdim=True) / 448.0
        return (x.float() / s).to(FP8), s

    return {
        "quantize_fp8": _time(lambda: quantize_fp8(x), iters, warmup),
        "dequantize_fp8_to_bf16": _time(lambda: dequantize_fp8(q, scales), iters, warmup),
        "torch_cast_quantize": _time(torch_cast_quantize, iters, warmup),
        "torch_cast_dequantize_to_bf16": _time(
            lambda: (q.float() * scales[:, None]).bfloat16(), iters, warmup
        ),
    }


def _request(seq: int, x: torch.Tensor, fp8: bool, k: int, with_codec: bool) -> FFNRequest:
    t = x.shape[0]
    hidden, scales = quantize_fp8(x) if fp8 else (x, None)
    return FFNRequest(
        layer=0,
        micro_batch=1 if with_codec else 0,
        seq=seq,
        hidden=hidden,  # [T, H]
        scales=scales,  # [T] | None
        expert_ids=torch.zeros(t, k, dtype=torch.int32),  # [T, k]
        expert_weights=torch.full((t, k), 1.0 / k),  # [T, k]
        t_send=time.time(),
    )


def _start_server(address: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [address, str(args.tokens), str(args.hidden), str(args.threads)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"bench FFN server did not start: {line!r}")
    return proc, line.split()[1]


def _trips(client, x: torch.Tensor, fp8: bool, codec: bool, args: argparse.Namespace) -> dict:
    ready = _request(0, x, fp8, args.top_k, codec)
    seqs = iter(range(1, 1 << 62))

    def trip() -> None:
        seq = next(seqs)
        if codec:  # the sender quantizes every time; the server dequantizes
            req = _request(seq, x, fp8, args.top_k, codec)
        else:
            req = dataclasses.replace(ready, seq=seq, t_send=time.time())
        client.send(req)
        reply = client.wait(seq, 10.0)
        if not reply.ok:
            raise RuntimeError(reply.error)

    return _time(trip, args.iters, args.warmup)


def _memory_copy(a2f_bytes: int, f2a_bytes: int, args: argparse.Namespace) -> dict:
    a2f = torch.empty(a2f_bytes, dtype=torch.uint8)
    f2a = torch.empty(f2a_bytes, dtype=torch.uint8)
    return _time(lambda: (a2f.clone(), f2a.clone()), args.iters, args.warmup)


def _round_trips(x: torch.Tensor, args: argparse.Namespace) -> dict:
    address = {
        "tcp": "tcp://127.0.0.1:0",
        "ipc": f"ipc:///tmp/afd-bench-{os.getpid()}.sock",
        "grpc": "grpc://127.0.0.1:0",
    }[args.transport]
    proc, address = _start_server(address, args)
    client = connect(address)
    t, h = x.shape
    try:
        return {
            "fp8": _trips(client, x, True, False, args),
            "bf16": _trips(client, x, False, False, args),
            "fp8_with_codec": _trips(client, x, True, True, args),
            "fp8_memory_copy": _memory_copy(t * h, t * h * 2, args),
            "bf16_memory_copy": _memory_copy(t * h * 2, t * h * 2, args),
        }
    finally:
        client.close()
        proc.stdin.close()
        proc.wait(10)


def _wire_bytes(x: torch.Tensor, k: int) -> dict:
    t = x.shape[0]
    f2a = sum(memoryview(f).nbytes for f in encode_reply(_reply_like(x)))
    out = {}
    for name, fp8 in (("fp8", True), ("bf16", False)):
        a2f = sum(memoryview(f).nbytes for f in encode_request(_request(0, x, fp8, k, False)))
        out[name] = {
            "a2f": round(a2f / t, 1),
            "f2a": round(f2a / t, 1),
            "total": round((a2f + f2a) / t, 1),
        }
    return out


def _reply_like(x: torch.Tensor) -> FFNReply:
    return FFNReply(seq=0, layer=0, micro_batch=0, output=x)  # [T, H] bf16


def run(args: argparse.Namespace) -> dict:
    """Run the three measurements; returns a JSON-able dict."""
    torch.set_num_threads(args.threads)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    x = x.bfloat16()  # [T, H], the attention side's compute dtype
    return {
        "config": {
            k: getattr(args, k)
            for k in ("tokens", "hidden", "top_k", "transport", "threads", "iters")
        },
        "codec": _codec(x, args.iters, args.warmup),
        "round_trip": _round_trips(x, args),
        "bytes_per_token_per_layer": _wire_bytes(x, args.top_k),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="afd bench wire", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="T, tokens per micro-batch")
    p.add_argument("--hidden", type=int, default=7168, help="H, hidden size (Step-3: 7168)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--transport", choices=["tcp", "ipc", "grpc"], default="tcp")
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    return p


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parser().parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
