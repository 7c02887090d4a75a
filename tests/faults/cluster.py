"""A real local cluster for fault, fuzz and soak tests: gateway, 2 attention servers and FFN
servers as separate processes (tcp data plane), each of which a test can kill, stop, resume and
restart; plus a client that classifies every request's outcome."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import ssl
import time
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx

from afd.config import EngineConfig
from afd.demo import TINY_CONFIG, write_step3_checkpoint
from services.gateway.client import AttentionClient
from tests.helpers.procs import Procs, free_port

FFN_TIMEOUT_S = 2.0  # the attention servers' deadline per FFN round trip
# The default --ffn-grace: how long a shard with no live replica may pause the streams.
GRACE_S = next(f.default for f in fields(EngineConfig) if f.name == "ffn_grace_s")
# A request in flight when a peer fails ends within this: the FFN deadline, plus a readiness
# ping that may hold the engine as long, plus the time the tiny model needs on a busy 2-core box.
HANG_BOUND_S = 3 * FFN_TIMEOUT_S + 6
# One TLS context for every client below (they speak plain HTTP, but httpx builds a context per
# call unless given one: ~40 ms of CPU each, which at 16 clients retrying a refused port starved
# the very gateway restart the soak waits for).
_TLS = ssl.create_default_context()


def tiny_model(root: Path) -> Path:
    return write_step3_checkpoint(root / "tiny", TINY_CONFIG, seed=0, init_std=0.2)


@dataclass
class Cluster:
    """`ffn` is the topology: a list of shards, each a list of replica names."""

    procs: Procs
    model: Path
    ffn: list[list[str]] = field(default_factory=lambda: [["ffn0a", "ffn0b"], ["ffn1"]])
    attention: list[str] = field(default_factory=lambda: ["att0", "att1"])
    addr: dict[str, str] = field(default_factory=dict)  # data / control-plane address
    side: dict[str, int] = field(default_factory=dict)  # HTTP side port
    url: str = ""

    def start(self) -> Cluster:
        for i, replicas in enumerate(self.ffn):
            for name in replicas:
                self.addr[name] = f"tcp://127.0.0.1:{free_port()}"
                self.start_ffn(name, i)
        for name in self.attention:
            self.addr[name] = f"127.0.0.1:{free_port()}"
            self.start_attention(name)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.procs.start(
            "gateway",
            "gateway",
            "--model",
            str(self.model),
            "--attention",
            ",".join(self.addr[a] for a in self.attention),
            "--port",
            str(port),
            "--drain-timeout",
            "20",
            # these drills count on the load being spread over the attention servers; their
            # prompts are all alike, which prefix-aware routing would send to one of them
            "--routing",
            "least-loaded",
        )
        self.wait_ready(120, servers=len(self.attention))
        return self

    def _flag_side(self, name: str) -> list[str]:
        self.side[name] = self.side.get(name) or free_port()
        return ["--metrics-port", str(self.side[name])]

    def start_ffn(self, name: str, shard: int | None = None) -> None:
        if shard is None:
            shard = next(i for i, reps in enumerate(self.ffn) if name in reps)
        self.procs.start(
            name,
            "ffn",
            "--model",
            str(self.model),
            "--shard",
            f"{shard}/{len(self.ffn)}",
            "--listen",
            self.addr[name],
            "--threads",
            "1",
            *self._flag_side(name),
        )

    def start_attention(self, name: str) -> None:
        ffn = ",".join("|".join(self.addr[r] for r in reps) for reps in self.ffn)
        self.procs.start(
            name,
            "attention",
            "--model",
            str(self.model),
            "--ffn",
            ffn,
            "--listen",
            self.addr[name],
            "--ffn-timeout",
            str(FFN_TIMEOUT_S),
            "--kv-cache-gb",
            "0.05",
            "--threads",
            "1",
            "--drain-timeout",
            "20",
            *self._flag_side(name),
        )

    # ---- signals

    def kill(self, name: str) -> None:
        self.procs.stop(name, sig=signal.SIGKILL)

    def pause(self, name: str) -> None:
        self.procs.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs.procs[name].send_signal(signal.SIGCONT)

    def restart(self, name: str) -> None:
        if name in self.procs.procs:
            self.kill(name)
        if name in self.attention:
            self.start_attention(name)
        else:
            self.start_ffn(name)

    # ---- observing

    def ready(self) -> tuple[int, dict]:
        try:
            r = httpx.get(f"{self.url}/ready", timeout=5, verify=_TLS)
            return r.status_code, r.json()
        except httpx.HTTPError as e:
            return 0, {"error": str(e)}

    def wait_ready(self, timeout: float, servers: int | None = None) -> dict:
        """Until the gateway is ready and (with `servers`) that many attention servers are."""
        deadline = time.monotonic() + timeout
        while True:
            for name, p in self.procs.procs.items():
                if p.poll() is not None and p.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"{name} exited {p.returncode}:\n{self.procs.log(name)}")
            code, body = self.ready()
            states = [s["state"] for s in body.get("servers", [])]
            if code == 200 and (servers is None or states.count("ready") >= servers):
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready after {timeout}s: {code} {body}")
            time.sleep(0.2)

    def stats(self) -> list:
        """Stats of every attention server whose process is running."""
        live = [a for a in self.attention if a in self.procs.procs]
        live = [a for a in live if self.procs.procs[a].poll() is None]

        async def go():
            out = []
            for name in live:
                c = AttentionClient(self.addr[name])
                try:
                    out.append(await c.stats())
                except Exception as e:  # a server that is down right now
                    out.append(e)
                await c.close()
            return out

        return asyncio.run(go())

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Every attention server: nothing running or waiting, no KV block in use."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if all(not isinstance(x, Exception) and x.running == x.waiting == 0 for x in s) and all(
                x.kv_usage == 0 for x in s
            ):
                return
            assert time.monotonic() < deadline, f"attention servers still hold work: {s}"
            time.sleep(0.1)

    def metric(self, name: str, metric: str) -> float:
        try:
            url = f"http://127.0.0.1:{self.side[name]}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:  # not listening (yet)
            return 0.0
        m = re.search(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@dataclass
class Outcome:
    # "ok" | "error" (typed) | "refused" (no connection: nothing was sent, the client may retry)
    # | "dropped" (connected, but closed before any response: a server closing its listener
    # with the connection still in its backlog; never read, the client may retry)
    # | "bad" (anything else: hang, 5xx other than 503, junk)
    kind: str
    tokens: int
    seconds: float
    detail: str = ""
    stall: float = 0.0  # longest wait for the next event of the stream, s


def stream(url: str, max_tokens: int, timeout: float = 60.0, prompt: str = "x") -> Outcome:
    """One streaming completion; every way it can end, classified."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    t0 = last = time.monotonic()
    tokens, finish, stall, answered = 0, None, 0.0, False
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=timeout, verify=_TLS
        ) as r:
            answered = True
            if r.status_code != 200:
                r.read()
                kind = "error" if r.status_code in (429, 503) else "bad"
                return Outcome(kind, 0, time.monotonic() - t0, f"{r.status_code} {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                stall, last = max(stall, now - last), now
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    code = ev["error"].get("code")
                    kind = "error" if code in ("unavailable", "overloaded") else "bad"
                    detail = json.dumps(ev)[:200]
                    return Outcome(kind, tokens, time.monotonic() - t0, detail, stall)
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                if ev["choices"]:
                    finish = ev["choices"][0].get("finish_reason") or finish
                    tokens = max(tokens, 1)  # it has started
    except httpx.ConnectError as e:
        return Outcome("refused", 0, time.monotonic() - t0, str(e))
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        kind = "bad" if answered else "dropped"
        return Outcome(kind, tokens, time.monotonic() - t0, f"{type(e).__name__}: {e}", stall)
    except httpx.HTTPError as e:
        return Outcome("bad", tokens, time.monotonic() - t0, f"{type(e).__name__}: {e}", stall)
    ok = finish == "length" and tokens == max_tokens
    kind = "ok" if ok else "bad"
    return Outcome(kind, tokens, time.monotonic() - t0, f"finish={finish}", stall)


def hang_up(url: str) -> str:
    """A client that leaves after the first event."""
    body = {"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30, verify=_TLS) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    return "hung up"
    except httpx.HTTPError:
        pass
    return "hung up"
