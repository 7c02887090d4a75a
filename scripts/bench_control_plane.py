"""The control plane alone: how many token events a second the gateway's client and the
attention server's servicer carry, with a Session (a step's events in one message) against a
Generate call per request.

    python scripts/bench_control_plane.py [--streams 32 256] [--tokens 100] [--rounds 3]

Both ends run in this process on one event loop (what is measured is their Python and gRPC
cost, not the engine's), over a real gRPC port; the engine is a stand-in that steps every
live request at once each millisecond (tests/helpers/control.py). The two modes alternate;
the JSON has every run, the medians, and Session over Generate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afd.control import SamplingParams  # noqa: E402
from afd_cli.bench.engine import _cpu  # noqa: E402
from services.gateway.client import AttentionClient  # noqa: E402
from tests.helpers.control import SteppingLoop, free_port, servicer, start_server  # noqa: E402


async def _drain(client: AttentionClient, rid: str, tokens: int) -> None:
    async for _ in client.generate(rid, [1, 2, 3], SamplingParams(max_tokens=tokens)):
        pass


async def _once(streams: int, tokens: int, session: bool) -> dict[str, float]:
    loop = SteppingLoop(start_when=streams, step_s=0.001)
    addr = f"127.0.0.1:{free_port()}"
    server = await start_server(servicer(loop, addr), addr)
    client = AttentionClient(addr)
    client._unary_only = not session  # the client's own fallback path: a Generate per request
    try:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        await asyncio.gather(*(_drain(client, f"r{i}", tokens) for i in range(streams)))
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await client.close()
        await server.stop(None)
        loop.close()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"events_s": streams * tokens / wall, "cpu_ms_per_step": cpu / tokens * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[32, 256])
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    results = []
    for streams in args.streams:
        runs: dict[str, list[dict[str, float]]] = {"generate": [], "session": []}
        for _ in range(args.rounds):
            for mode in ("generate", "session"):
                runs[mode].append(asyncio.run(_once(streams, args.tokens, mode == "session")))
        med = {
            mode: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
            for mode, rs in runs.items()
        }
        results.append(
            {
                "streams": streams,
                "runs": runs,
                "median": med,
                "session_over_generate_events_s": round(
                    med["session"]["events_s"] / med["generate"]["events_s"], 2
                ),
            }
        )
    print(json.dumps({"benchmark": "control_plane", "cpu": _cpu(), "tokens": args.tokens,
                      "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
