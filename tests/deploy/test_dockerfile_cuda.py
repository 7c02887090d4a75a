"""deploy/Dockerfile's two variants: the CPU image (no build arguments) and the CUDA image (a
CUDA base and PyTorch's CUDA wheel index). Neither a CUDA base nor the CUDA wheel can be fetched
here, so the steps that differ are run through /bin/sh as the build runs them, with pip and
apt-get stubbed to print what they were asked for; the build commands checked are the ones
deploy/README.md gives."""

from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.deploy.sources import DEPLOY, K8S, dockerfile_stages

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# what each stub prints: its name and arguments on one line, separated by '|'
ECHO = "#!/bin/sh\nprintf '%s' \"${0##*/}\"; printf '|%s' \"$@\"; echo\n"


def _shell(run: str, args: dict[str, str], python: bool = True) -> list[list[str]]:
    """The commands a RUN step calls, given its stage's ARG values (the defaults, overridden by
    `args` as --build-arg does) and whether the base has a python3. Nothing but the stubs is on
    PATH, so a step that reaches for anything else fails here."""
    with tempfile.TemporaryDirectory() as bin_dir:
        stubs = {"pip": ECHO, "apt-get": ECHO, "rm": "#!/bin/sh\n"}
        stubs["python3"] = f"#!/bin/sh\nexit {0 if python else 1}\n"
        for name, body in stubs.items():
            path = Path(bin_dir) / name
            path.write_text(body)
            path.chmod(0o755)
        out = subprocess.run(
            ["/bin/sh", "-c", run],
            env={"PATH": bin_dir, **args},
            capture_output=True,
            text=True,
            timeout=10,
        )
    assert out.returncode == 0, out.stderr
    return [line.split("|") for line in out.stdout.splitlines()]


def _stage_args(stage: list[tuple[str, str]], given: dict[str, str]) -> dict[str, str]:
    args = {}
    for instr, rest in stage:
        if instr == "ARG":
            name, _, default = rest.partition("=")
            args[name] = given.get(name, default)
    return args


def torch_install(given: dict[str, str]) -> list[str]:
    """The arguments the build gives `pip install` for torch."""
    (stage,) = [s for s in dockerfile_stages() if any("torch==" in r for i, r in s if i == "RUN")]
    (run,) = [r for i, r in stage if i == "RUN" and "torch==" in r]
    calls = [c for c in _shell(run, _stage_args(stage, given)) if c[0] == "pip"]
    (torch,) = [c[2:] for c in calls if c[1] == "install" and any(a.startswith("torch") for a in c)]
    return torch


def readme_builds() -> dict[str, dict[str, str]]:
    """Each `docker build` deploy/README.md gives: its tag -> its build arguments."""
    text = (DEPLOY / "README.md").read_text().replace("\\\n", " ")
    builds = {}
    for line in re.findall(r"^docker build -f deploy/Dockerfile .*$", text, re.MULTILINE):
        words = shlex.split(line.split("#")[0])
        tag = words[words.index("-t") + 1]
        pairs = [words[i + 1] for i, w in enumerate(words) if w == "--build-arg"]
        builds[tag] = dict(p.split("=", 1) for p in pairs)
    return builds


def _cpu_and_cuda() -> tuple[tuple[str, dict], tuple[str, dict]]:
    builds = readme_builds()
    assert len(builds) == 2, f"deploy/README.md: one CPU and one CUDA build, got {builds}"
    (cpu,) = [(t, a) for t, a in builds.items() if not t.endswith("-cuda")]
    (cuda,) = [(t, a) for t, a in builds.items() if t.endswith("-cuda")]
    return cpu, cuda


def test_the_cpu_build_installs_the_cpu_wheel():
    (_, args), _ = _cpu_and_cuda()
    assert args == {}, "the CPU image is the one built with no arguments"
    assert torch_install(args) == ["--index-url", CPU_INDEX, "torch==2.13.0"]


def test_the_cuda_build_installs_the_wheel_of_its_base_cuda_release():
    (cpu_tag, _), (tag, args) = _cpu_and_cuda()
    assert set(args) == {"BASE", "TORCH_INDEX_URL"}
    release = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu\d+\.\d+", args["BASE"])
    assert release, args["BASE"]
    index = "https://download.pytorch.org/whl/cu" + "".join(release.groups())
    assert args["TORCH_INDEX_URL"] == index
    # the same pin: the local label (+cu128) is not part of what `==` compares
    assert torch_install(args) == ["--index-url", index, "torch==2.13.0"]
    assert tag == cpu_tag + "-cuda"


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ("https://download.pytorch.org/whl/cu126", ["--index-url", "https://download.pytorch.org/whl/cu126"]),
        ("", []),  # empty: PyPI's own torch, no --index-url at all
    ],
)  # fmt: skip
def test_the_index_argument_alone_switches_the_wheel(index, expected):
    assert torch_install({"TORCH_INDEX_URL": index}) == [*expected, "torch==2.13.0"]


def test_the_kubernetes_gpu_pools_run_the_tags_the_builds_make():
    (cpu_tag, _), (cuda_tag, _) = _cpu_and_cuda()
    (base,) = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]
    assert f"{base['name']}:{base['newTag']}" == cpu_tag
    for role in ("attention", "ffn"):
        kust = K8S / "components" / f"gpu-{role}" / "kustomization.yaml"
        (image,) = yaml.safe_load(kust.read_text())["images"]
        assert f"{base['name']}:{image['newTag']}" == cuda_tag, role


@pytest.mark.parametrize("stage", [0, -1], ids=["build", "runtime"])
def test_a_base_without_python_gets_it_from_apt(stage):
    """A CUDA runtime base has no Python: each stage's first step installs it from apt; a base
    with one (the default) installs nothing."""
    steps = dockerfile_stages()[stage]
    first = next(r for i, r in steps if i == "RUN")
    apt = [c for c in _shell(first, {}, python=False) if c[0] == "apt-get"]
    installs = [c for c in apt if c[1] == "install"]
    assert len(installs) == 1 and "python3" in installs[0], apt
    if stage == 0:  # the build stage makes the venv
        assert "python3-venv" in installs[0]
    assert _shell(first, {}) == []
