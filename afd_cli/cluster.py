"""The local cluster behind `afd serve`: its child processes, started and stopped in order.

Starts M FFN servers, N attention servers and the gateway as separate child processes
(`python -m afd_cli ffn|attention|gateway ...`), waits until the gateway's /ready answers 200,
prints the URL, and on Ctrl-C or SIGTERM stops the children in stages, each with SIGTERM, then
SIGKILL after a grace period: the gateway first (it drains: new requests get 503 while those in
flight finish, up to --drain-timeout), then the attention servers (which drain the same way),
then the FFN servers, which the requests in flight needed until the end. Each child runs in its
own process group (so one terminal Ctrl-C reaches only this process, which then stops the
children in order) and is asked by the kernel
(PR_SET_PDEATHSIG) to die with its parent, so even `kill -9` of this process leaves no orphans.
Every line a child writes comes out prefixed with its name: `[ffn-0]`, `[attention-1]`, ...
Each attention and FFN server gets a free HTTP side port for /metrics (and /health, /ready);
the launcher prints where every service's /metrics is once the cluster is ready.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from afd import hugepages
from afd.config import CacheConfig, check, check_device
from afd.errors import AfdError
from afd.flags import FFN_FLAGS, field_default, served_name
from afd_cli.procs import die_with_parent, free_port, pump_lines, signal_group

log = logging.getLogger("afd.serve")

TRANSPORTS = ("auto", "tcp", "ipc", "grpc", "inproc")
# auto: separate FFN processes only where each compute process gets this many cores or more
CORES_PER_PROCESS = 2


def topology(
    transport: str, attention: int, ffn: int, cores: int, elastic: bool = False,
    one_gpu: bool = False,
) -> str:  # fmt: skip
    """The data plane `afd serve` runs. "auto": the FFN shards in their own processes over tcp
    when every compute process (attention and FFN) can have CORES_PER_PROCESS cores; on a
    smaller host (a laptop, a 2-core VM) inside each attention process (inproc), where the
    step's attention and FFN halves would otherwise take turns on cores of their own, one of
    them idle at any moment; and inproc where both roles compute on one and the same GPU
    (`one_gpu`): processes there would each plan the device's memory without the others (the
    attention server's KV cache takes --gpu-memory-utilization of it), while in one process
    the shards' weights are loaded before the KV cache is planned, and the shards take the
    attention side's device tensors with no copy. Any other value is kept: a user can always
    ask for processes. An elastic FFN pool is processes joining and leaving: tcp where auto
    would say inproc."""
    if transport != "auto":
        return transport
    if elastic:
        return "tcp"
    if one_gpu:
        return "inproc"
    return "tcp" if cores >= CORES_PER_PROCESS * (attention + ffn) else "inproc"


def one_gpu(attention_device: str, ffn_device: str) -> bool:
    """Both roles resolve to the same CUDA device on this host."""
    from afd.device import resolve

    att, ffn = resolve(attention_device), resolve(ffn_device)
    return att.type == "cuda" and att == ffn


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None  # None: the embedded demo model
    attention: int = 1  # N attention servers
    ffn: int = 1  # M FFN servers (expert shards)
    # attention -> FFN data plane (inproc: the FFN shards inside each attention process; auto:
    # by the host's cores, see topology())
    transport: str = "auto"
    host: str = "127.0.0.1"  # the gateway's; every internal socket binds to 127.0.0.1
    port: int = 8000  # the gateway's; 0: any free port
    api_key: str = ""  # required on the HTTP API; empty: none
    threads: int = 0  # torch threads per compute process; 0: share the cores out
    ready_timeout_s: float = 300.0  # for /ready to answer 200
    # A child that dies once the cluster is up is restarted (backing off); one that dies more
    # than this many times within restart_window_s is crash-looping: the cluster stops.
    max_restarts: int = 5
    restart_window_s: float = 60.0
    stop_timeout_s: float = 10.0  # beyond the drain, per stage
    # On Ctrl-C / SIGTERM: how long the gateway and attention servers let requests in flight
    # finish (new ones get 503).
    drain_timeout_s: float = 30.0
    engine_args: tuple[str, ...] = ()  # engine flags for every attention server
    api_args: tuple[str, ...] = ()  # HTTP API flags for the gateway
    # the model's names in the API (none: its directory's); responses carry the first
    served_model_name: tuple[str, ...] = ()
    dtype: str = "bfloat16"  # compute dtype of the attention and FFN servers
    # where each role computes (afd/device.py); "" per role: `device`
    device: str = "auto"
    attention_device: str = ""
    ffn_device: str = ""
    # FFN servers that each hold every expert, in a pool the attention servers read from a
    # file: servers can be added and removed while the cluster runs (afd_cli/elastic.py)
    elastic_ffn: bool = False
    admin_port: int = 0  # the authenticated admin endpoint (adding/removing FFN servers); 0: off

    def __post_init__(self) -> None:
        check(self.transport in TRANSPORTS, f"--transport must be one of {', '.join(TRANSPORTS)}")
        for spec in (self.device, self.attention_device, self.ffn_device):
            if spec:
                check_device(spec)
        check(
            self.attention >= 1 and self.ffn >= 1,
            "--attention and --ffn must be >= 1",
        )
        check(self.threads >= 0, f"--threads must be >= 0, got {self.threads}")
        check(self.ready_timeout_s > 0 and self.stop_timeout_s > 0, "timeouts must be > 0")
        check(self.drain_timeout_s >= 0, "the drain timeout must be >= 0")
        check(self.max_restarts >= 0, "--max-restarts must be >= 0 (0: stop on any death)")
        check(self.restart_window_s > 0, "--restart-window must be > 0")
        check(
            not (self.elastic_ffn and self.transport == "inproc"),
            "--elastic-ffn needs FFN processes: a network transport, not inproc",
        )
        check(0 <= self.admin_port < 65536, f"--admin-port {self.admin_port} is not a port")
        check(
            not self.admin_port or (self.elastic_ffn and self.api_key),
            "--admin-port needs --elastic-ffn (what it changes) and an API key (--api-key or "
            "$AFD_API_KEY): it starts and stops processes",
        )


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    proc: subprocess.Popen | None = None
    pump: threading.Thread | None = None
    metrics_url: str = ""  # where its Prometheus metrics are
    address: str = ""  # an FFN server's data-plane address


class Cluster:
    """The child processes of one local cluster. Use as a context manager, or start()/stop()."""

    def __init__(self, cfg: ClusterConfig, log_sink=None):
        self.cfg = cfg
        self._sink = log_sink or sys.stderr.buffer
        self._tmp: str | None = None
        self.children: list[Child] = []
        self.port = cfg.port or free_port(cfg.host)
        self.attention_addresses: list[str] = []
        self.ffn_addresses: list[str] = []
        # where every compute process would share one GPU (afd_cli/cluster.py: topology)
        self.one_gpu = one_gpu(cfg.attention_device or cfg.device, cfg.ffn_device or cfg.device)
        self.transport = topology(
            cfg.transport, cfg.attention, cfg.ffn, os.cpu_count() or 1, cfg.elastic_ffn,
            self.one_gpu,
        )  # fmt: skip
        self.lock = threading.Lock()  # children: the supervisor and the admin endpoint
        self.pool_file: Path | None = None  # the elastic pool's member list
        self.env: dict[str, str] = {}  # every child's, measured once here (start)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every child's /metrics, by child name (gateway, attention-i, ffn-i)."""
        return {c.name: c.metrics_url for c in self.children if c.metrics_url}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return (self.cfg.served_model_name or (served_name(self.cfg.model),))[0]

    @property
    def topology(self) -> str:
        """What runs where, in words (afd serve prints it)."""
        c, t = self.cfg, self._threads()
        where = (
            "FFN shards inside each attention process"
            if self.transport == "inproc"
            else f"{c.ffn} FFN process(es) over {self.transport}"
        )
        return f"{c.attention} attention process(es), {where}; {t} torch thread(s) each"

    def _threads(self) -> int:
        if self.cfg.threads:
            return self.cfg.threads
        heavy = self.cfg.attention + (0 if self.transport == "inproc" else self.cfg.ffn)
        return max(1, (os.cpu_count() or 1) // heavy)

    def tmpdir(self) -> str:
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="afd-serve-")
        return self._tmp

    def ffn_address(self, i: int) -> str:
        """A data-plane address for FFN server i (also one joining an elastic pool)."""
        t = self.transport
        if t == "inproc":
            return f"inproc://ffn-{i}"  # shards inside each attention process
        if t == "ipc":
            return f"ipc://{self.tmpdir()}/ffn-{i}.sock"
        return f"{t}://127.0.0.1:{free_port()}"

    def plan(self) -> list[Child]:
        """The children to start, in start order (FFN, attention, gateway)."""
        c = self.cfg
        py = [sys.executable, "-m", "afd_cli"]
        model = ["--model", c.model] if c.model else []
        threads = ["--threads", str(self._threads()), "--dtype", c.dtype]
        self.ffn_addresses = [self.ffn_address(i) for i in range(c.ffn)]
        children = []
        if self.transport != "inproc":
            children = [self.ffn_child(i, c.ffn) for i in range(c.ffn)]
        if c.elastic_ffn:
            from services.attention.pool_source import write_pool

            self.pool_file = Path(self.tmpdir()) / "ffn-pool"
            write_pool(self.pool_file, self.ffn_addresses)
        for i in range(c.attention):
            addr = f"127.0.0.1:{free_port()}"
            self.attention_addresses.append(addr)
            argv = [*py, "attention", *model, *threads, *c.engine_args, "--listen", addr]
            argv += ["--device", c.attention_device or c.device]
            argv += ["--ffn-device", c.ffn_device or c.device]  # its in-process shards' (inproc)
            if self.one_gpu and c.attention > 1 and "--gpu-memory-utilization" not in c.engine_args:
                # N attention servers on one GPU: each plans its KV cache from 1/N of the
                # default share (a share given on the command line is each server's own)
                share = field_default(CacheConfig, "gpu_memory_utilization") / c.attention
                argv += ["--gpu-memory-utilization", f"{share:.4f}"]
            if self.transport == "inproc" and "--a2f-dtype" not in c.engine_args:
                # FP8 exists to cut the bytes on a network; in one process it would only cost
                # time and precision: hand the hidden states over in bf16, as they are
                argv += ["--a2f-dtype", "bf16"]
            argv += ["--drain-timeout", str(c.drain_timeout_s)]
            if self.pool_file is not None:
                argv += ["--ffn-pool", f"file:{self.pool_file}"]
            else:
                argv += ["--ffn", ",".join(self.ffn_addresses)]
            children.append(_with_metrics_port(Child(f"attention-{i}", argv)))
        gw = [*py, "gateway", *model, "--attention", ",".join(self.attention_addresses)]
        gw += ["--host", c.host, "--port", str(self.port)]
        gw += [*c.api_args, "--drain-timeout", str(c.drain_timeout_s)]
        gw += ["--served-model-name", *c.served_model_name] if c.served_model_name else []
        # The key travels in the environment: a command line is readable by every local user.
        env = {"AFD_API_KEY": c.api_key} if c.api_key else {}
        host = "127.0.0.1" if c.host in ("0.0.0.0", "::", "") else c.host
        children.append(Child("gateway", gw, env, metrics_url=f"http://{host}:{self.port}/metrics"))
        return children

    def ffn_child(self, i: int, of: int, address: str = "") -> Child:
        """FFN server i: expert shard i of `of`, or, in an elastic pool, every expert."""
        c = self.cfg
        addr = address or self.ffn_addresses[i]
        argv = [sys.executable, "-m", "afd_cli", "ffn", *(["--model", c.model] if c.model else [])]
        argv += ["--threads", str(self._threads()), "--dtype", c.dtype, "--listen", addr]
        argv += ["--device", c.ffn_device or c.device]
        if not c.elastic_ffn:
            argv += ["--shard", f"{i}/{of}"]
        argv += _ffn_args(c.engine_args)
        # stopped last, once no attention server is left to send them anything
        argv += ["--drain-timeout", "0"]
        return _with_metrics_port(Child(f"ffn-{i}", argv, address=addr))

    def start(self) -> None:
        if not self.cfg.model:
            from afd.demo import demo_model_dir

            demo_model_dir()  # build it once here, not raced by every child
        from afd_cli import measured  # torch: not for --help

        c = self.cfg
        devices = [c.attention_device or c.device, c.ffn_device or c.device]
        self.env = measured.children_env(devices, self._threads())
        for child in self.plan():
            self.launch(child)
            self.children.append(child)

    def launch(self, child: Child) -> None:
        """Start (or start again) one child, with the same command line: the same ports."""
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **self.env, **child.env}
        if child.name != "gateway":  # a server that loads weights: in 2 MiB pages as it does
            env |= hugepages.child_env(env)
        parent = os.getpid()
        child.proc = subprocess.Popen(
            child.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,
            preexec_fn=lambda: die_with_parent(parent),
        )
        child.pump = threading.Thread(
            target=pump_lines, args=(child.name, child.proc.stdout, self._sink), daemon=True
        )
        child.pump.start()
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def dead(self) -> Child | None:
        """A child that has exited, if any."""
        return next((c for c in self.children if c.proc and c.proc.poll() is not None), None)

    def wait_ready(self, stop: threading.Event | None = None) -> None:
        """Block until /ready answers 200; raise if a child dies or time runs out."""
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        probe = f"http://{host}:{self.port}/ready"
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                raise AfdError("stopped before the cluster was ready")
            gone = self.dead()
            if gone is not None:
                raise AfdError(
                    f"{gone.name} exited with code {gone.proc.returncode} during start-up "
                    "(its log lines above say why)"
                )
            try:
                with urllib.request.urlopen(probe, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 until every attention server is ready
            time.sleep(0.25)
        raise AfdError(f"the cluster was not ready within {self.cfg.ready_timeout_s:.0f} s")

    def stop(self) -> None:
        """Stop the children in stages: the gateway, then the attention servers (both drain
        first), then the FFN servers; each stage SIGTERM, then SIGKILL past its time."""
        for role in ("gateway", "attention", "ffn"):
            stage = [
                c
                for c in self.children
                if c.name.split("-")[0] == role and c.proc and c.proc.poll() is None
            ]
            drains = role != "ffn"
            self._stop_stage(stage, self.cfg.stop_timeout_s + (self.cfg.drain_timeout_s * drains))
        for c in self.children:
            signal_group(c.proc, signal.SIGKILL)  # stragglers in a child's group
            if c.pump is not None:
                c.pump.join(timeout=2)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    def _stop_stage(children: list[Child], timeout: float) -> None:
        for c in children:
            signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in children:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", c.name, timeout)
                signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()


def _ffn_args(engine_args: tuple[str, ...]) -> list[str]:
    """The engine flags that FFN servers take too: how they multiply MXFP4 experts, and how
    the weights are quantized as they load."""
    out = []
    for flag, value in zip(engine_args, engine_args[1:], strict=False):
        if flag in FFN_FLAGS:
            out += [flag, value]
    return out


def _with_metrics_port(child: Child) -> Child:
    """The child with a free side port for /metrics (internal: bound to 127.0.0.1)."""
    port = free_port()
    child.argv += ["--metrics-port", str(port)]
    child.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return child
