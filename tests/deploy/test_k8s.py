"""deploy/k8s: every kustomization renders offline, the built-in kinds pass
`kubernetes-validate --strict` against a current Kubernetes, the PodMonitor (a CRD, for which
kubernetes-validate has no schema) passes a strict schema shipped here, and the manifests hold
together: node pools, shard ordinals, probe endpoints, grace periods, budgets, the autoscaler's
metric and the network policy's reach."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.sources import (
    K8S_VERSION,
    by_kind,
    config_data,
    defined_metric_names,
    in_ci,
    kustomize_cmd,
    matches,
    one,
    overlays,
    render,
)

pytestmark = pytest.mark.skipif(
    kustomize_cmd() is None and not in_ci(),
    reason="no kustomize renderer here (kubectl kustomize or kustomize); CI has kubectl",
)

SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json"
}
POOL = "afd.io/pool"
GPU = "nvidia.com/gpu"
ROLES = ("gateway", "attention", "ffn")
OVERLAYS = overlays()


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request) -> list[dict]:
    return render(request.param)


def _require_validator():
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        if in_ci():
            raise
        pytest.skip("kubernetes-validate is not installed (a test extra)")


def _validate_cli(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def workload(docs: list[dict], role: str) -> dict:
    found = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == role
    ]
    assert len(found) == 1, f"one workload per role: {role}"
    return found[0]


def pod_spec(docs, role) -> dict:
    return workload(docs, role)["spec"]["template"]["spec"]


def container(docs, role) -> dict:
    (c,) = pod_spec(docs, role)["containers"]
    return c


def flag(c: dict, name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(name + "=")]
    return value


def gpus(c: dict) -> int:
    """The NVIDIA GPUs a container is given (its limit: what the device plugin allocates)."""
    return int(c.get("resources", {}).get("limits", {}).get(GPU, 0))


def named_port(c: dict, ref) -> int:
    if isinstance(ref, int):
        return ref
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == ref]
    return p


# ------------------------------------------------------------------ validation


def test_builtin_kinds_pass_kubernetes_validate_strict(docs, tmp_path):
    _require_validator()
    out = _validate_cli(docs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    passed = [x for x in lines if x.startswith("INFO") and "passed" in x]
    warned = [x for x in lines if x.startswith("WARN")]
    builtin = [d for d in docs if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS]
    assert len(passed) == len(builtin), out.stdout
    # The only resources it could not check are the CRDs checked below against our schema.
    assert len(warned) == len(docs) - len(builtin)
    assert all("PodMonitor" in w for w in warned), warned


def test_strict_validation_catches_an_unknown_field(tmp_path):
    """The control: the same validator rejects a misspelt field, so a pass above means something."""
    _require_validator()
    docs = render("base")
    bad = copy.deepcopy(workload(docs, "ffn"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    out = _validate_cli([bad], tmp_path)
    assert out.returncode != 0 and "readinesProbe" in out.stdout


def test_crds_pass_their_shipped_schema(docs):
    _require_validator()  # brings jsonschema
    import jsonschema

    crds = [d for d in docs if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
    assert crds, "the PodMonitor is part of every rendering"
    for d in crds:
        schema = json.loads((SCHEMAS / CRD_SCHEMAS[d["apiVersion"], d["kind"]]).read_text())
        jsonschema.Draft202012Validator(schema).validate(d)
        typo = copy.deepcopy(d)
        typo["spec"]["podMetricEndpoints"] = typo["spec"].pop("podMetricsEndpoints")
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(schema).validate(typo)


def test_every_volume_has_one_source(docs):
    for role in ROLES:
        for v in pod_spec(docs, role)["volumes"]:
            assert len(set(v) - {"name"}) == 1, (role, v)


# ------------------------------------------------------------------ placement


def test_attention_and_ffn_run_on_separate_node_pools(docs):
    specs = {r: pod_spec(docs, r) for r in ("attention", "ffn")}
    if all("nodeSelector" not in s for s in specs.values()):
        ns = workload(docs, "ffn")["metadata"].get("namespace")
        assert ns == "afd-dev", "only the one-node dev overlay drops the pools"
        return
    for role, spec in specs.items():
        # a pool moved onto GPUs has a node pool of its own (test_k8s_gpu.py checks which)
        pool = f"{role}-gpu" if gpus(container(docs, role)) else role
        assert spec["nodeSelector"] == {POOL: pool}
        tol = [t for t in spec["tolerations"] if t["key"] == POOL]
        assert tol == [{"key": POOL, "operator": "Equal", "value": pool, "effect": "NoSchedule"}]


# ------------------------------------------------------------------ wiring


def _elastic(docs) -> bool:
    return any(a.startswith("--ffn-pool") for a in container(docs, "attention")["args"])


def _attention_hpa(docs) -> dict:
    name = workload(docs, "attention")["metadata"]["name"]
    (hpa,) = [
        h
        for h in by_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == name
    ]
    return hpa


def test_ffn_shard_index_is_the_pod_ordinal(docs):
    if _elastic(docs):
        pytest.skip("an elastic pool has no shards (test_elastic_pool_is_found_through_dns)")
    sts, cfg = workload(docs, "ffn"), config_data(docs)
    assert sts["kind"] == "StatefulSet"
    n = sts["spec"]["replicas"]
    assert cfg["AFD_FFN_SHARDS"] == str(n)
    c = container(docs, "ffn")
    assert flag(c, "--shard") == "$(POD_INDEX)/$(AFD_FFN_SHARDS)"
    (idx,) = [e for e in c["env"] if e["name"] == "POD_INDEX"]
    assert idx["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    svc = one(docs, "Service", sts["spec"]["serviceName"])
    data = named_port(c, "data")
    assert flag(c, "--listen") == f"tcp://0.0.0.0:{data}"
    name = sts["metadata"]["name"]
    expected = [f"tcp://{name}-{i}.{svc['metadata']['name']}:{data}" for i in range(n)]
    assert cfg["AFD_FFN_ADDRESSES"].split(",") == expected
    assert flag(container(docs, "attention"), "--ffn") == "$(AFD_FFN_ADDRESSES)"
    targets = {
        h["spec"]["scaleTargetRef"]["name"] for h in by_kind(docs, "HorizontalPodAutoscaler")
    }
    assert name not in targets, "the shard count is fixed: never autoscale a sharded pool"


def test_gateway_lists_every_attention_ordinal_the_autoscaler_may_start(docs):
    sts, cfg = workload(docs, "attention"), config_data(docs)
    hpa = _attention_hpa(docs)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": sts["metadata"]["name"],
    }
    assert "replicas" not in sts["spec"], "the autoscaler owns the attention replica count"
    c = container(docs, "attention")
    grpc = named_port(c, "grpc")
    assert flag(c, "--listen") == f"0.0.0.0:{grpc}"
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    expected = [f"{name}-{i}.{svc}:{grpc}" for i in range(hpa["spec"]["maxReplicas"])]
    assert cfg["AFD_ATTENTION_ADDRESSES"].split(",") == expected
    assert flag(container(docs, "gateway"), "--attention") == "$(AFD_ATTENTION_ADDRESSES)"


def test_autoscaler_scales_attention_on_waiting_requests(docs):
    hpa = _attention_hpa(docs)
    spec = hpa["spec"]
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "afd_num_requests_waiting"
    defined = defined_metric_names()
    if not any("waiting" in m for m in defined):
        pytest.skip("afd/metrics.py defines no waiting-requests gauge yet")
    assert name in defined, f"{name} is not an attention metric in afd/metrics.py: {defined}"


def test_elastic_pool_is_found_through_dns_and_scaled_on_ffn_load(docs):
    """overlays/elastic: FFN pods hold every expert, the attention servers read the pool from
    a headless Service of the ready FFN pods, an autoscaler owns the FFN pod count."""
    if not _elastic(docs):
        pytest.skip("a static sharded pool (test_ffn_shard_index_is_the_pod_ordinal)")
    sts, ffn = workload(docs, "ffn"), container(docs, "ffn")
    assert "replicas" not in sts["spec"], "the autoscaler owns the FFN pod count"
    assert not any(a.startswith("--shard") for a in ffn["args"]), "every pod holds every expert"
    pool = flag(container(docs, "attention"), "--ffn-pool")
    scheme, _, rest = pool.partition(":")
    assert scheme == "dns"
    name, port = rest.removeprefix("tcp://").rsplit(":", 1)
    svc = one(docs, "Service", name)
    assert svc["spec"]["clusterIP"] == "None" and not svc["spec"]["publishNotReadyAddresses"]
    assert matches({"matchLabels": svc["spec"]["selector"]}, _template_labels(docs, "ffn"))
    assert int(port) == named_port(ffn, "data") == int(flag(ffn, "--listen").rsplit(":", 1)[1])
    (hpa,) = [
        h
        for h in by_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == sts["metadata"]["name"]
    ]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and ffn["resources"]["requests"]["cpu"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_services_select_their_pods_and_ports(docs):
    for svc in by_kind(docs, "Service"):
        spec = svc["spec"]
        backends = [
            r
            for r in ROLES
            if matches({"matchLabels": spec["selector"]}, _template_labels(docs, r))
        ]
        assert len(backends) == 1, (svc["metadata"]["name"], backends)
        c = container(docs, backends[0])
        for p in spec["ports"]:
            named_port(c, p["targetPort"])  # exists
    for role in ("attention", "ffn"):
        sts = workload(docs, role)
        svc = one(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None", "headless: pods are addressed by name"


def _template_labels(docs, role) -> dict:
    return workload(docs, role)["spec"]["template"]["metadata"]["labels"]


# ------------------------------------------------------------------ probes and lifecycle


def test_probes_hit_the_right_endpoints(docs):
    for role in ("attention", "ffn"):
        c = container(docs, role)
        side = int(flag(c, "--metrics-port"))
        assert flag(c, "--metrics-host") == "0.0.0.0"
        for probe, path in (
            ("startupProbe", "/health"),
            ("livenessProbe", "/health"),
            ("readinessProbe", "/ready"),
        ):
            get = c[probe]["httpGet"]
            assert (get["path"], named_port(c, get["port"])) == (path, side), (role, probe)
    c = container(docs, "gateway")
    port = int(flag(c, "--port"))
    # /ready is true while at least one attention server is (the ordinals the autoscaler has
    # not started are merely down) and false while the gateway drains: deploy/README.md.
    for probe, path in (
        ("startupProbe", "/health"),
        ("livenessProbe", "/health"),
        ("readinessProbe", "/ready"),
    ):
        get = c[probe]["httpGet"]
        assert (get["path"], named_port(c, get["port"])) == (path, port), probe


def _drain_timeout(role: str, c: dict) -> float:
    """The service's drain on SIGTERM: its --drain-timeout (given, or the CLI's default) once
    the CLI has one; until then the attention server's fixed 2 s stop grace."""
    import argparse

    from afd_cli.main import build_parser

    (subs,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subs.choices[role]._actions:
        if any("drain" in s for s in action.option_strings):
            given = [
                a.split("=", 1)[1] for a in c["args"] if a.split("=")[0] in action.option_strings
            ]
            return float(given[0] if given else action.default)
    return 2.0


def test_termination_grace_outlasts_the_drain(docs):
    for role in ROLES:
        spec, c = pod_spec(docs, role), container(docs, role)
        pre = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert spec["terminationGracePeriodSeconds"] >= _drain_timeout(role, c) + pre + 10, role


def test_disruption_budgets_cover_each_workload(docs):
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for role in ROLES:
        mine = [p for p in pdbs if matches(p["spec"]["selector"], _template_labels(docs, role))]
        assert len(mine) == 1, role
        spec = mine[0]["spec"]
        # A budget that can never be met blocks every node drain.
        replicas = workload(docs, role)["spec"].get("replicas", 1)
        if "minAvailable" in spec:
            assert spec["minAvailable"] < replicas, role
        else:
            assert spec["maxUnavailable"] >= 1, role


def test_containers_run_unprivileged(docs):
    for role in ROLES:
        spec, c = pod_spec(docs, role), container(docs, role)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/cache", "/tmp", "/models"} <= mounts, "writable cache and tmp, models mount"


# ------------------------------------------------------------------ monitoring and policy


def test_pod_monitor_scrapes_every_service(docs):
    (pm,) = by_kind(docs, "PodMonitor")
    ports = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    for role in ROLES:
        assert matches(pm["spec"]["selector"], _template_labels(docs, role)), role
        c = container(docs, role)
        have = {p["name"] for p in c["ports"]} & ports
        assert len(have) == 1, (role, have)
        served = int(flag(c, "--metrics-port" if role != "gateway" else "--port"))
        assert named_port(c, have.pop()) == served, role


def _allowed(docs, target_role: str, port_name: str, source_labels: dict | None) -> bool:
    """NetworkPolicy semantics for one ingress: may a pod with `source_labels` in the same
    namespace (None: from outside the namespace) reach `port_name` on `target_role`'s pods?"""
    target = _template_labels(docs, target_role)
    port = named_port(container(docs, target_role), port_name)
    policies = [
        p for p in by_kind(docs, "NetworkPolicy") if matches(p["spec"]["podSelector"], target)
    ]
    if not any("Ingress" in p["spec"]["policyTypes"] for p in policies):
        return True
    c = container(docs, target_role)
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(named_port(c, x["port"]) == port for x in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                assert set(peer) == {"podSelector"}, "same-namespace pod peers only"
                if source_labels is not None and matches(peer["podSelector"], source_labels):
                    return True
    return False


def test_only_the_attention_pool_reaches_the_ffn_data_port(docs):
    labels = {r: _template_labels(docs, r) for r in ROLES}
    assert _allowed(docs, "ffn", "data", labels["attention"])
    assert not _allowed(docs, "ffn", "data", labels["gateway"])
    assert not _allowed(docs, "ffn", "data", labels["ffn"])
    assert not _allowed(docs, "ffn", "data", {"app": "other"})
    assert not _allowed(docs, "ffn", "data", None)
    # Prometheus and the kubelet still reach the side port; only gateways the control port.
    assert _allowed(docs, "ffn", "metrics", None)
    assert _allowed(docs, "attention", "grpc", labels["gateway"])
    assert not _allowed(docs, "attention", "grpc", {"app": "other"})
    assert _allowed(docs, "attention", "metrics", None)


# ------------------------------------------------------------------ secure transport


def _mounted_files(spec: dict, c: dict, secrets: dict[str, list[str]]) -> dict[str, str]:
    """path in the container -> the Secret key behind it, for every Secret volume mounted
    (`secrets`: each Secret's keys, as `kubectl create secret --from-file` would make them)."""
    files = {}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c["volumeMounts"]:
        secret = volumes[m["name"]].get("secret")
        if secret is None:
            continue
        items = secret.get("items") or [
            {"key": k, "path": k} for k in secrets[secret["secretName"]]
        ]
        for item in items:
            assert item["key"] in secrets[secret["secretName"]], item
            files[f"{m['mountPath']}/{item['path']}"] = item["key"]
        assert oct(secret["defaultMode"]) == "0o440", "readable by the pod's fsGroup, no one else"
    return files


def test_secure_overlay_gives_each_service_the_keys_afd_reads(tmp_path):
    """overlays/secure: every AFD_CURVE_DIR / AFD_TLS_* a service is given points at files its
    Secret mounts provide, laid out as afd.security reads them: real keys from `afd keys`, put
    where the Secret items would put them, load as the FFN (CURVE server) and the attention
    server (CURVE client) load them."""
    from afd.security import Security, write_curve_keys

    docs = render("overlays/secure")
    curve = write_curve_keys(tmp_path / "keys")
    secrets = {
        "afd-curve": ["server.key", "server.key_secret", "client.key", "client.key_secret"],
        "afd-tls": ["tls.crt", "tls.key", "ca.crt"],
    }
    for role, wants in (("ffn", {"curve"}), ("attention", {"curve", "tls"}), ("gateway", {"tls"})):
        spec, c = pod_spec(docs, role), container(docs, role)
        files = _mounted_files(spec, c, secrets)
        env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
        assert ("AFD_CURVE_DIR" in env) == ("curve" in wants), role
        assert ("AFD_TLS_CA" in env) == ("tls" in wants), role
        for name in ("AFD_TLS_CERT", "AFD_TLS_KEY", "AFD_TLS_CA"):
            if name in env:
                assert env[name] in files, (role, name)
        if "curve" not in wants:
            continue
        root = tmp_path / role
        for path, key in files.items():
            if path.startswith(env["AFD_CURVE_DIR"] + "/"):
                dest = root / path.removeprefix(env["AFD_CURVE_DIR"] + "/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes((curve / key).read_bytes())
        sec = Security(curve_dir=str(root))
        if role == "ffn":
            assert sec.curve_keys("server") == Security(curve_dir=str(curve)).curve_keys("server")
            assert (Path(sec.authorized_dir) / "client.key").is_file()
            assert not (root / "client.key_secret").exists()  # the server holds no client secret
        else:
            sec.curve_keys("client")
            assert sec.server_public_key() == Security(curve_dir=str(curve)).server_public_key()
            assert not (root / "server.key_secret").exists()
