"""The rendered Kubernetes manifests run for real without a cluster: each pod's container args
expanded as the kubelet does ($(VAR) from envFrom, env, the downward API: the pod ordinal from
the StatefulSet's pod-index label), the image's entrypoint and ENV under them, every declared
containerPort moved to a free local port and every Service / pod DNS name resolved to the pod
standing behind it. Pods are ready when their own readinessProbe says so; then a chat completion
goes through the gateway's Service and every PodMonitor endpoint is scraped."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest

from tests.deploy.localrun import (
    LocalCluster,
    Proc,
    chat,
    free_port,
    http_ok,
    localize_argv,
    localize_text,
    metrics,
)
from tests.deploy.sources import (
    by_kind,
    defined_metric_names,
    dockerfile_env,
    dockerfile_instructions,
    expand,
    in_ci,
    kustomize_cmd,
    matches,
    render,
)

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        kustomize_cmd() is None and not in_ci(),
        reason="no kustomize renderer here (kubectl kustomize or kustomize); CI has kubectl",
    ),
]

OVERLAY = "overlays/dev"
NAMESPACE_SUFFIXES = (".svc.cluster.local", ".svc")


class Pod:
    def __init__(self, name: str, labels: dict, spec: dict):
        self.name, self.labels, self.spec = name, labels, spec
        (self.container,) = spec["containers"]  # afd pods run one container
        declared = {p["containerPort"]: free_port() for p in self.container.get("ports", [])}
        self.named = {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}
        self.proc = Proc(name, [], {}, declared, fixed_ports=True)

    def port(self, ref) -> int:
        """A container port by number or by name."""
        return self.named[ref] if isinstance(ref, str) else ref


def _pods(docs: list[dict]) -> tuple[list[Pod], dict[str, int]]:
    """The pods the workloads ask for, and each StatefulSet's possible size (its HPA's max)."""
    hpa_of = {
        h["spec"]["scaleTargetRef"]["name"]: h["spec"]
        for h in by_kind(docs, "HorizontalPodAutoscaler")
    }
    pods, capacity = [], {}
    for sts in by_kind(docs, "StatefulSet"):
        name, spec = sts["metadata"]["name"], sts["spec"]
        hpa = hpa_of.get(name)
        # With no replicas the autoscaler owns the count and keeps at least minReplicas.
        n = spec.get("replicas") or (hpa["minReplicas"] if hpa else 1)
        capacity[name] = hpa["maxReplicas"] if hpa else n
        for i in range(n):
            labels = {**spec["template"]["metadata"]["labels"]}
            labels["apps.kubernetes.io/pod-index"] = str(i)
            labels["statefulset.kubernetes.io/pod-name"] = f"{name}-{i}"
            pods.append(Pod(f"{name}-{i}", labels, spec["template"]["spec"]))
    for dep in by_kind(docs, "Deployment"):
        # Replicas of a Deployment run the same container: one is enough to prove the command.
        spec = dep["spec"]
        pods.append(
            Pod(
                f"{dep['metadata']['name']}-0",
                spec["template"]["metadata"]["labels"],
                spec["template"]["spec"],
            )
        )
    return pods, capacity


def _container_env(pod: Pod, docs: list[dict], namespace: str) -> dict[str, str]:
    c = pod.container
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src.get("configMapRef") or src.get("secretRef")
        kind = "ConfigMap" if "configMapRef" in src else "Secret"
        found = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == ref["name"]]
        assert found or ref.get("optional"), f"{pod.name}: envFrom {kind} {ref['name']} missing"
        if found:
            env.update(found[0].get("data", {}))
    fields = {
        "metadata.name": pod.name,
        "metadata.namespace": namespace,
        "status.podIP": "127.0.0.1",
        **{f"metadata.labels['{k}']": v for k, v in pod.labels.items()},
    }
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            path = vf["fieldRef"]["fieldPath"]
            assert path in fields, f"{pod.name}: {path} is not set on this pod"
            env[e["name"]] = fields[path]
        else:
            ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
            kind = "ConfigMap" if "configMapKeyRef" in vf else "Secret"
            found = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == ref["name"]]
            if not found:
                assert ref.get("optional"), f"{pod.name}: {kind} {ref['name']} missing"
                continue
            env[e["name"]] = found[0]["data"][ref["key"]]
    return env


def _sees(gateway: str, running: list[str]) -> bool:
    try:
        with urllib.request.urlopen(f"{gateway}/ready", timeout=5) as r:
            reasons = json.load(r).get("reasons", [])
    except urllib.error.HTTPError as e:
        reasons = json.load(e).get("reasons", [])
    except (urllib.error.URLError, OSError):
        return False
    return not any(addr in why for addr in running for why in reasons)


def _entrypoint() -> list[str]:
    (entry,) = [rest for instr, rest in dockerfile_instructions() if instr == "ENTRYPOINT"]
    return json.loads(entry)


def test_k8s_manifests_run_and_answer_a_chat(tmp_path):
    docs = render(OVERLAY)
    namespace = docs[0]["metadata"].get("namespace") or "default"
    for d in docs:
        namespace = d["metadata"].get("namespace", namespace)
    pods, capacity = _pods(docs)
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    sts_service = {
        s["metadata"]["name"]: s["spec"]["serviceName"] for s in by_kind(docs, "StatefulSet")
    }
    by_name = {p.name: p for p in pods}
    dead: dict[tuple[str, int], int] = {}

    def resolve(host: str, port: int) -> tuple[str, int]:
        for suffix in NAMESPACE_SUFFIXES:
            if host.endswith(suffix):
                host = host[: -len(suffix)].rsplit(".", 1)[0]  # drop ".<namespace>.svc..."
        parts = host.split(".")
        if len(parts) == 2:  # <pod>.<headless service>
            pod_name, svc = parts
            assert svc in services and services[svc]["spec"].get("clusterIP") == "None", host
            owner, _, ordinal = pod_name.rpartition("-")
            assert sts_service.get(owner) == svc, f"{host}: no StatefulSet {owner} behind {svc}"
            assert int(ordinal) < capacity[owner], f"{host}: beyond the StatefulSet's reach"
            if pod_name not in by_name:  # an ordinal the autoscaler has not started: unreachable
                return "127.0.0.1", dead.setdefault((pod_name, port), free_port())
            pod = by_name[pod_name]
            assert port in pod.proc.ports, f"{host}:{port}: not a declared containerPort"
            return "127.0.0.1", pod.proc.ports[port]
        (svc,) = parts
        assert svc in services, f"{host}: no such Service"
        spec = services[svc]["spec"]
        (sp,) = [p for p in spec["ports"] if p["port"] == port]
        backends = [p for p in pods if matches({"matchLabels": spec["selector"]}, p.labels)]
        assert backends, f"Service {svc} selects no pod"
        target = backends[0]
        return "127.0.0.1", target.proc.ports[target.port(sp.get("targetPort", port))]

    image_env = {k: v for k, v in dockerfile_env().items() if k != "PATH"}
    image_env["AFD_CACHE_DIR"] = str(tmp_path / "cache")  # each pod's /cache emptyDir; shared here
    entry = _entrypoint()
    assert entry == ["afd"], entry
    launch = {}
    for pod in pods:
        c = pod.container
        assert "command" not in c, "containers rely on the image's entrypoint"
        own = _container_env(pod, docs, namespace)
        args = [expand(a, {**image_env, **own}) for a in c["args"]]
        assert not any("$(" in a for a in args), f"{pod.name}: unexpanded {args}"
        argv = localize_argv(args, pod.proc, resolve)
        # The image's ENV only matters to Docker's HEALTHCHECK (unused by Kubernetes): as is.
        own = {k: localize_text(v, pod.proc, resolve) for k, v in own.items()}
        launch[pod.name] = (argv, {**image_env, **own})

    deadline = time.monotonic() + 150
    with LocalCluster(tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}) as cluster:
        for name, (argv, env) in launch.items():
            cluster.start(name, argv, env)
        for pod in pods:
            probe = pod.container["readinessProbe"]["httpGet"]
            url = f"http://127.0.0.1:{pod.proc.ports[pod.port(probe['port'])]}{probe['path']}"
            cluster.wait(f"{pod.name} ready", lambda u=url: http_ok(u), deadline)

        host, port = resolve("afd-gateway", services["afd-gateway"]["spec"]["ports"][0]["port"])
        gateway = f"http://{host}:{port}"
        running = [f"127.0.0.1:{p.proc.ports[p.port('grpc')]}" for p in pods if "grpc" in p.named]
        # Ready for traffic: the gateway sees every started attention server ready; only the
        # ordinals the autoscaler has not started are reported down.
        cluster.wait("gateway routing", lambda: _sees(gateway, running), deadline)
        time.sleep(0.5)  # two router polls: the unstarted ordinals are marked down
        reply = chat(gateway)

        (monitor,) = by_kind(docs, "PodMonitor")
        scraped = {}
        for pod in pods:
            for ep in monitor["spec"]["podMetricsEndpoints"]:
                if ep["port"] in pod.named and matches(monitor["spec"]["selector"], pod.labels):
                    url = f"http://127.0.0.1:{pod.proc.ports[pod.named[ep['port']]]}{ep['path']}"
                    scraped[pod.name] = metrics(url)

    assert reply["usage"]["completion_tokens"] == 6
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert set(scraped) == set(by_name), "every pod is scraped by the PodMonitor"
    # The ordinal is the shard: afd-ffn-i was started as shard i of N.
    for pod in pods:
        if pod.name.startswith("afd-ffn-"):
            i = pod.labels["apps.kubernetes.io/pod-index"]
            assert any(a.startswith(f"--shard={i}/") for a in launch[pod.name][0])
    # The autoscaler's metric is one the attention servers really export.
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    if metric in defined_metric_names():
        for name, text in scraped.items():
            if name.startswith("afd-attention-"):
                assert f"\n{metric}" in text or text.startswith(metric), (name, metric)
