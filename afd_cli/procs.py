"""Process plumbing for `afd serve`: free ports, children that die with their parent, their
output prefixed line by line, signals to a child's process group."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_HANDED_OUT: set[int] = set()  # ports this process gave a child: not given again


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the child binds it a moment later). Taken below the
    kernel's ephemeral range when it can be: a port from that range can become the source port
    of any outgoing connection (a health probe, a client) before the child binds it. Never the
    same port twice in one process: a child still starting has not bound its port yet."""
    low = ephemeral_range()[0]
    for _ in range(64):
        port = random.randrange(10000, low) if low > 10000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port found on {host} below {low}")


def die_with_parent(parent: int) -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when its parent exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def pump_lines(name: str, stream, out) -> None:
    """Copy a child's output line by line, each prefixed with the child's name."""
    prefix = f"[{name}] ".encode()
    for line in iter(stream.readline, b""):
        # A progress bar redraws itself with \r: keep what a terminal would end up showing.
        shown = [p for p in line.rstrip(b"\r\n").split(b"\r") if p.strip()]
        if not shown:
            continue
        try:
            out.write(prefix + shown[-1] + b"\n")
            out.flush()
        except (OSError, ValueError):
            pass  # our own stderr went away; keep draining so the child never blocks
    stream.close()


def signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group (process_group=0)
    except (ProcessLookupError, PermissionError):
        pass


def stop_child(child, timeout_s: float) -> None:
    """SIGTERM a child's process group, SIGKILL it past `timeout_s`; wait for its output."""
    proc = child.proc
    if proc is not None and proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
    if child.pump is not None:
        child.pump.join(timeout=2)
