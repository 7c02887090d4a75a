"""deploy/docker-compose.yml run for real without Docker: every afd service's command and
environment (the image's ENV under the service's own) as a local process, in depends_on order,
each dependency's own healthcheck command deciding when it is healthy; then a chat completion
through the gateway's published port and a scrape of every Prometheus target."""

from __future__ import annotations

import os
import shlex
import sys
import time
from graphlib import TopologicalSorter

import pytest
import yaml

from afd.demo import TINY_CONFIG, write_step3_checkpoint
from tests.deploy.localrun import (
    LocalCluster,
    Proc,
    chat,
    command_ok,
    localize_argv,
    localize_text,
    metrics,
)
from tests.deploy.sources import DEPLOY, compose_file, dockerfile_env

pytestmark = pytest.mark.timeout(240)

# What a user would export to size the cluster for a small machine.
SMALL = {"AFD_THREADS": "1", "AFD_KV_CACHE_GB": "0.1"}


def _is_afd(svc: dict) -> bool:
    return (svc.get("build") or {}).get("dockerfile") == "deploy/Dockerfile"


def _env_list(env) -> dict[str, str]:
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in (env or {}).items()}


def _mounts(svc: dict, named: dict[str, str]) -> list[tuple[str, str]]:
    """(container path, local path) for each volume: a bind's host path, or a fresh directory
    standing in for a named volume."""
    out = []
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        out.append((dst, src if src.startswith(("/", ".")) else named[src]))
    return out


def _remap_paths(argv: list[str], mounts: list[tuple[str, str]]) -> list[str]:
    out = []
    for arg in argv:
        flag, eq, value = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
        for dst, src in mounts:
            if value == dst or value.startswith(dst + "/"):
                value = src + value[len(dst) :]
        out.append(f"{flag}{eq}{value}")
    return out


def run_compose(tmp_path, user_env: dict[str, str]) -> dict:
    doc = compose_file(user_env)
    services = {n: s for n, s in doc["services"].items() if _is_afd(s)}
    assert len(services) == 5, sorted(services)
    cache = tmp_path / "cache"  # AFD_CACHE_DIR: /cache in every container; shared here
    named = {}
    for name in doc.get("volumes", {}):
        named[name] = str(tmp_path / "volumes" / name)
        os.makedirs(named[name])
    image_env = {k: v for k, v in dockerfile_env().items() if k != "PATH"}
    image_env["AFD_CACHE_DIR"] = str(cache)

    procs = {
        n: Proc(n, list(s["command"]), {**image_env, **_env_list(s.get("environment"))})
        for n, s in services.items()
    }

    def resolve(host: str, port: int) -> tuple[str, int]:
        assert host in procs, f"{host}:{port} names no service of the compose file"
        return "127.0.0.1", procs[host].local(port)

    argv, env = {}, {}
    for n, p in procs.items():
        argv[n] = _remap_paths(localize_argv(p.argv, p, resolve), _mounts(services[n], named))
        env[n] = {k: localize_text(v, p, resolve) for k, v in p.env.items()}

    def healthy(n: str) -> bool:
        kind, line = services[n]["healthcheck"]["test"]
        assert kind == "CMD-SHELL" and line.startswith("python "), (kind, line)
        # the container's `python`, here this test's interpreter
        line = shlex.quote(sys.executable) + line.removeprefix("python")
        return command_ok(["/bin/sh", "-c", line], {**os.environ, **env[n]})

    order = TopologicalSorter({n: set(s.get("depends_on", {})) for n, s in services.items()})
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    deadline = time.monotonic() + 150
    with LocalCluster(tmp_path, base) as cluster:
        for n in order.static_order():
            for dep, cond in services[n].get("depends_on", {}).items():
                if cond["condition"] == "service_healthy":
                    cluster.wait(f"{dep} healthy", lambda d=dep: healthy(d), deadline)
            cluster.start(n, argv[n], env[n])
        cluster.wait("gateway healthy", lambda: healthy("gateway"), deadline)

        published = services["gateway"]["ports"][0].split(":")
        assert published[-1] == "8000"
        reply = chat(f"http://127.0.0.1:{procs['gateway'].local(int(published[-1]))}")

        # Prometheus's targets (deploy/prometheus.yml, when it is there), each scraped for real.
        targets = _prometheus_targets() or [
            f"{n}:{_metrics_port(s['command'])}" for n, s in services.items()
        ]
        scraped = {}
        for t in targets:
            host, port = t.rsplit(":", 1)
            h, p = resolve(host, int(port))
            scraped[t] = metrics(f"http://{h}:{p}/metrics")
    return {"reply": reply, "scraped": scraped, "argv": argv}


def _metrics_port(command: list[str]) -> str:
    """Where a service serves /metrics: its side port, or the gateway's own HTTP port."""
    flags = dict(a.split("=", 1) for a in command if a.startswith("--") and "=" in a)
    return flags.get("--metrics-port") or flags["--port"]


def _prometheus_targets() -> list[str]:
    path = DEPLOY / "prometheus.yml"
    if not path.exists():
        return []
    conf = yaml.safe_load(path.read_text())
    return [
        t
        for job in conf.get("scrape_configs", [])
        for sc in job.get("static_configs", [])
        for t in sc.get("targets", [])
    ]


def test_compose_cluster_on_the_demo_model_answers_a_chat(tmp_path):
    out = run_compose(tmp_path, SMALL)
    reply = out["reply"]
    assert reply["usage"]["completion_tokens"] == 6
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert reply["model"] == "afd-demo-step3"
    # every afd service exported metrics, and the gateway counted the request
    assert len(out["scraped"]) >= 5
    assert any("afd_" in text for text in out["scraped"].values())


@pytest.mark.slow  # the same compose file as the demo case; only the model's source differs
def test_compose_cluster_on_a_mounted_model_dir(tmp_path):
    models = tmp_path / "host-models"
    write_step3_checkpoint(models / "tiny-step3", TINY_CONFIG, seed=0, init_std=0.2)
    env = {**SMALL, "AFD_MODELS_DIR": str(models), "AFD_MODEL": "/models/tiny-step3"}
    out = run_compose(tmp_path, env)
    assert out["reply"]["model"] == "tiny-step3"
    assert out["reply"]["usage"]["completion_tokens"] == 6
    for argv in out["argv"].values():
        assert f"--model={models}/tiny-step3" in argv
