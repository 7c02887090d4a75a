"""Run a deployment's containers as local processes: the same argv (after the image's
entrypoint, `afd`) and environment, every port a container listens on moved to a free port on
127.0.0.1, and every name another container is reached by (a compose service, a Kubernetes
Service or pod DNS name) resolved to the local port standing in for it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from afd_cli.procs import free_port, signal_group
from tests.deploy.sources import REPO
from tests.helpers.procs import stop_processes

LOOPBACK = "127.0.0.1"
_WILDCARD = {"0.0.0.0", "::", "[::]", "127.0.0.1", "localhost"}
# Flags whose value is a port this process listens on, and flags whose value is its interface.
_PORT_FLAGS = ("--port", "--metrics-port")
_HOST_FLAGS = ("--host", "--metrics-host")
_ADDR = re.compile(r"(?P<scheme>[a-z]+://)?(?P<host>[A-Za-z0-9._-]+|\[::\]):(?P<port>\d{2,5})\b")


@dataclass
class Proc:
    """One container, about to become one local process."""

    name: str
    argv: list[str]  # after the entrypoint
    env: dict[str, str]
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port
    fixed_ports: bool = False  # True: only declared ports may be listened on (Kubernetes)

    def local(self, port: int) -> int:
        if port not in self.ports:
            assert not self.fixed_ports, f"{self.name} listens on {port}, not a declared port"
            self.ports[port] = free_port()
        return self.ports[port]


Resolve = Callable[[str, int], tuple[str, int]]  # (name, port) -> (host, port) here


def localize_text(text: str, me: Proc, resolve: Resolve) -> str:
    """Rewrite every HOST:PORT in `text`: this container's own addresses to its local ports,
    other names through `resolve` (which fails for a name the deployment does not define)."""

    def one(m: re.Match) -> str:
        host, port = m.group("host"), int(m.group("port"))
        if host in _WILDCARD:
            h, p = LOOPBACK, me.local(port)
        else:
            h, p = resolve(host, port)
        return f"{m.group('scheme') or ''}{h}:{p}"

    return _ADDR.sub(one, text)


def localize_argv(argv: list[str], me: Proc, resolve: Resolve) -> list[str]:
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in _PORT_FLAGS + _HOST_FLAGS:
            if not eq:
                value = next(it)
            if flag in _PORT_FLAGS:
                value = str(me.local(int(value)))
            elif value in _WILDCARD:
                value = LOOPBACK  # bind loopback only: nothing here is for other machines
            out.append(f"{flag}={value}")
        else:
            out.append(localize_text(arg, me, resolve))
    return out


class LocalCluster:
    """Start processes, wait for their health checks, and always stop them (SIGTERM, then
    SIGKILL) on exit."""

    def __init__(self, log_dir: Path, base_env: dict[str, str]):
        self.log_dir = log_dir
        self.base_env = base_env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        # The image's entrypoint is the `afd` console script, i.e. afd_cli.main:main.
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "afd_cli", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**self.base_env, **env},
            start_new_session=True,
        )

    def logs(self, tail: int = 2500) -> str:
        parts = []
        for name in self.procs:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
            parts.append(f"--- {name} ---\n{text[-tail:]}")
        return "\n".join(parts)

    def wait(self, what: str, check: Callable[[], bool], deadline: float) -> None:
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"exited while waiting for {what}: {dead}\n{self.logs()}"
            if check():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        stop_processes(list(self.procs.values()), signal_group)  # each leads its group


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 400
    except (urllib.error.URLError, OSError):
        return False


def command_ok(argv: list[str], env: dict[str, str]) -> bool:
    """A health-check command (exec form) run here: exit 0 means healthy."""
    try:
        return subprocess.run(argv, env=env, capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def chat(base_url: str, max_tokens: int = 6, api_key: str = "") -> dict:
    """One chat completion through the gateway, with the model name it advertises."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
    except urllib.error.HTTPError as e:
        raise AssertionError(f"/v1/models: HTTP {e.code}: {e.read()[:2000]!r}") from e
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello from a deployment test."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"chat completion: HTTP {e.code}: {e.read()[:2000]!r}") from e


def metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200, url
        return r.read().decode()
