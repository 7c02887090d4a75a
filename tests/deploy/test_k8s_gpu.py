"""deploy/k8s on GPUs: components/gpu-attention and components/gpu-ffn each move one pool onto a
GPU node pool. In every rendering a pool's GPU, its `--device`, its node pool and its image
agree, each overlay moves exactly the pools it says, and every server's args, expanded as the
kubelet expands them, parse with afd's own CLI (which also holds `--device cuda` to a value
afd knows)."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.deploy.sources import config_data, expand, in_ci, kustomize_cmd, overlays, render
from tests.deploy.test_k8s import GPU, POOL, ROLES, container, gpus, pod_spec

pytestmark = pytest.mark.skipif(
    kustomize_cmd() is None and not in_ci(),
    reason="no kustomize renderer here (kubectl kustomize or kustomize); CI has kubectl",
)

# The pools each overlay puts on GPUs; every other overlay keeps them all on the CPU.
ON_GPU = {
    "overlays/gpu-attention": {"attention"},
    "overlays/gpu-ffn": {"ffn"},
    "overlays/gpu": {"attention", "ffn"},
}


@pytest.fixture(scope="module", params=overlays())
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def test_each_overlay_puts_on_gpus_exactly_the_pools_it_names(rendered):
    name, docs = rendered
    assert set(ON_GPU) <= set(overlays()), "an overlay named here is gone"
    on_gpu = {role for role in ROLES if gpus(container(docs, role))}
    assert on_gpu == ON_GPU.get(name, set())


def test_a_gpu_pool_has_its_device_node_pool_and_image(rendered):
    """A GPU pool: one GPU requested and limited, `--device=cuda`, its own tainted node pool,
    the CUDA image. A CPU pool: none of them, so no pod waits for a GPU it will not use, and
    none is told to compute on one it does not have."""
    _, docs = rendered
    cpu_image = container(docs, "gateway")["image"]  # the gateway never runs torch
    assert ":" in cpu_image.rsplit("/", 1)[-1], f"{cpu_image}: an image without a tag"
    for role in ("attention", "ffn"):
        c, spec = container(docs, role), pod_spec(docs, role)
        resources = c["resources"]
        requested = resources.get("requests", {}).get(GPU)
        limited = resources.get("limits", {}).get(GPU)
        devices = [a for a in c["args"] if a.split("=")[0] == "--device"]
        if not gpus(c):
            assert requested is None and limited is None, role
            assert devices == [], f"{role}: the CPU image's --device auto is the CPU"
            assert c["image"] == cpu_image, role
            continue
        assert requested == limited == 1, role
        assert devices == ["--device=cuda"], role
        assert spec["nodeSelector"][POOL] == f"{role}-gpu"
        gpu_taint = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
        assert gpu_taint in spec["tolerations"], role
        assert c["image"] == f"{cpu_image}-cuda", role


def _parse(argv: list[str]):
    """afd's own parser on a container's args; its complaint as the failure."""
    from afd_cli.main import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"afd {' '.join(argv)}:\n{err.getvalue()}")


def test_every_server_args_parse_with_the_afd_cli(rendered):
    from afd.config import CacheConfig, check_device

    _, docs = rendered
    for role in ROLES:
        c = container(docs, role)
        env = {**config_data(docs), "POD_INDEX": "0"}  # the ordinal comes from a pod label
        env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
        argv = [expand(a, env) for a in c["args"]]
        assert not any("$(" in a for a in argv), f"{role}: a variable nothing defines: {argv}"
        args = _parse(argv)
        assert args.command == role
        if role == "gateway":
            continue
        check_device(args.device)
        if role == "attention":  # the value itself must be one the cache config takes
            CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization)
