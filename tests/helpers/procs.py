"""Real service processes for system tests: start, wait until ready, always stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import grpc

# below the ephemeral range, never the same port twice: a port from bind(0) can become an
# outgoing connection's source port before the child it was given to binds it
from afd_cli.procs import free_port  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parents[2]


class Procs:
    """Children of one test module; `stop_all` terminates them (kill after a grace period)."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`afd *args` as a child; `env` is added to this process's environment."""
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **_measured_once(),
            **(env or {}),
        }
        p = subprocess.Popen(
            [sys.executable, "-m", "afd_cli", "--log-level", "WARNING", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        self.procs[name] = p
        return p

    def exited(self) -> str:
        """The children that have exited, each with its exit code and the end of its log."""
        out = ""
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = "\n".join(self.log(name).splitlines()[-15:])
                out += f"\n{name} exited with {p.returncode}:\n{tail}"
        return out

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.procs.pop(name)
        if p.poll() is None:
            p.send_signal(sig)
            _reap(p)

    def stop_all(self) -> None:
        procs, self.procs = list(self.procs.values()), {}
        stop_processes(procs)


def stop_processes(procs: list[subprocess.Popen], send=None) -> None:
    """SIGTERM to every process, then a second one to those still running half a second later:
    what a test ends with is not a drain test, and a second signal cuts a drain short (an idle
    FFN server answers 'draining' for its --drain-timeout, 3 s, to whoever might still send).
    SIGKILL past 10 s. `send(proc, sig)` signals one (default: the process itself)."""
    send = send or (lambda p, sig: p.send_signal(sig))
    for p in procs:
        if p.poll() is None:
            send(p, signal.SIGTERM)
    deadline = time.monotonic() + 0.5  # each has taken the first signal and begun draining
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            send(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()


@cache
def _measured_once() -> dict[str, str]:
    """What `afd serve` measures once and hands every child (afd_cli/measured.py), measured
    here once for every child of the session: the children multiply alike, as a cluster's do,
    and none spends its start-up measuring."""
    from afd_cli import measured

    return measured.children_env(["cpu"], 1)


def _reap(p: subprocess.Popen) -> None:
    """Wait for a signalled child; kill it past 10 s."""
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def wait_attention_ready(addr: str, timeout: float = 60.0, procs: Procs | None = None, name=""):
    from afd.control import pb, pb_grpc
    from afd.security import channel

    deadline = time.monotonic() + timeout
    last = ""
    with channel(addr, [], None) as ch:  # afd's reconnection: gRPC's backs off for seconds
        stub = pb_grpc.AttentionServiceStub(ch)
        while time.monotonic() < deadline:
            if procs and name and procs.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{procs.log(name)}")
            try:
                h = stub.Health(pb.HealthRequest(), timeout=5)
                if h.ready:
                    return
                last = h.reason
            except grpc.RpcError as e:
                last = str(e.code())
            time.sleep(0.3)
    exited = procs.exited() if procs else ""
    raise TimeoutError(f"attention server {addr} not ready after {timeout}s: {last}{exited}")


def generate(addr: str, prompt: list[int], max_tokens: int, timeout: float = 60.0, **sampling):
    """Token ids and the final event of one Generate call on the control plane."""
    from afd.control import pb, pb_grpc

    with grpc.insecure_channel(addr) as ch:
        stub = pb_grpc.AttentionServiceStub(ch)
        req = pb.GenerateRequest(
            request_id=f"t-{time.monotonic_ns()}",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
        )
        tokens, last = [], None
        for ev in stub.Generate(req, timeout=timeout):
            tokens += list(ev.token_ids)
            last = ev
        return tokens, last


def children_of(parent: int, role: str) -> list[int]:
    """The pids of `parent`'s direct children running `afd <role>` (e.g. `afd serve`'s), in
    start order."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if int(fields[1]) == parent and role.encode() in argv:
            found.append((int(fields[19]), int(d.name)))  # (start time, pid)
    return [pid for _, pid in sorted(found)]


def open_fds(pid: int) -> int:
    """Open file descriptors of a live process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    """Resident memory of a live process, MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
