"""deploy/Dockerfile, checked where no Docker engine runs: its install is .ci/run's (one source
of truth), the files it copies build a working wheel, and the image is what the compose file
and the Kubernetes manifests assume (entrypoint `afd`, non-root, a health check)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy.sources import (
    DEPLOY,
    REPO,
    ci_test_command,
    dockerfile_env,
    dockerfile_instructions,
    dockerfile_stages,
    pip_installs,
)

INSTR = dockerfile_instructions()


def _docker_installs() -> list[list[str]]:
    return [i for instr, rest in INSTR if instr == "RUN" for i in pip_installs(rest)]


def test_install_steps_are_the_ci_install():
    ci = pip_installs(ci_test_command())
    docker = _docker_installs()
    torch = [i for i in ci if any(a.startswith("torch") for a in i)]
    assert torch == [["torch==2.13.0"]], ci  # the pin, exactly as .ci/run has it
    assert [i for i in docker if any(a.startswith("torch") for a in i)] == torch
    # The project itself: .ci/run's editable install with the test extra; the image's with the
    # structured one (a served model's response_format needs xgrammar).
    (ci_project,) = [i for i in ci if i not in torch]
    (image_project,) = [i for i in docker if i not in torch]
    target = [a for a in ci_project if a != "-e"]
    assert [re.sub(r"\[test\]$", "", a) for a in target] == ["."]
    assert image_project == [".[structured]"]
    # Torch first, then the project, as in .ci/run (else pip resolves torch to a CUDA build).
    assert docker == [torch[0], image_project]


def test_torch_comes_from_the_cpu_index_unless_told_otherwise():
    args = {rest.split("=")[0]: rest for instr, rest in INSTR if instr == "ARG"}
    assert args["TORCH_INDEX_URL"].endswith("download.pytorch.org/whl/cpu")
    assert args["BASE"].startswith("BASE=python:3.11")
    assert INSTR[0][0] == "ARG" and INSTR[0][1].startswith("BASE=")  # before the first FROM
    assert all(rest.startswith("${BASE}") for instr, rest in INSTR if instr == "FROM")


def test_no_syntax_line_that_would_pull_a_frontend_offline():
    text = (DEPLOY / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)


def test_entrypoint_is_the_afd_console_script():
    (entry,) = [json.loads(r) for i, r in INSTR if i == "ENTRYPOINT"]
    assert entry == ["afd"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["afd"] == "afd_cli.main:main"  # what the live tests run as `python -m afd_cli`
    (cmd,) = [json.loads(r) for i, r in INSTR if i == "CMD"]
    assert cmd[0] == "gateway"


def test_runs_as_a_non_root_user_with_a_health_check():
    runtime = dockerfile_stages()[-1]
    (user,) = [r for i, r in runtime if i == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert user == "10001:10001"
    (add,) = [r for i, r in runtime if i == "RUN" and "useradd" in r]
    # the group the Kubernetes manifests' runAsGroup/fsGroup name, not one useradd picks
    assert "groupadd --system --gid 10001 afd" in add and "--uid 10001 --gid 10001" in add
    (hc,) = [r for i, r in runtime if i == "HEALTHCHECK"]
    test = hc[hc.index("CMD") + 3 :].strip()
    # the shell form (podman's Docker API splits the exec form's arguments on spaces)
    assert test.startswith('python -c "') and "AFD_HEALTH_URL" in test
    # By default the gateway's liveness endpoint on the port its default command serves.
    (cmd,) = [json.loads(r) for i, r in INSTR if i == "CMD"]
    port = cmd[cmd.index("--port") + 1]
    assert dockerfile_env()["AFD_HEALTH_URL"] == f"http://127.0.0.1:{port}/health"
    assert dockerfile_env()["AFD_CACHE_DIR"] == "/cache"


@pytest.mark.timeout(180)
def test_copied_sources_build_a_working_wheel(tmp_path):
    """Stage exactly what the build stage COPYs, then `pip wheel` it as `pip install .` would."""
    build = dockerfile_stages()[0]
    (workdir,) = [r for i, r in build if i == "WORKDIR"]
    src = tmp_path / "context"
    ignored = {x for x in (DEPLOY / "Dockerfile.dockerignore").read_text().split() if x[0] != "#"}
    skip = shutil.ignore_patterns("__pycache__", "*_pb2.py", "*_pb2_grpc.py")
    for instr, rest in build:
        if instr != "COPY":
            continue
        *sources, dest = rest.split()
        assert not any(s.startswith("--") for s in sources), rest
        into = src / dest if dest not in (".", "./") else src
        for s in sources:
            assert s not in ignored, f"{s} is copied but Dockerfile.dockerignore drops it"
            if (REPO / s).is_dir():  # COPY dir dest: the directory's contents into dest
                shutil.copytree(REPO / s, into, ignore=skip, dirs_exist_ok=True)
            else:
                into.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / s, into / Path(s).name if dest.endswith("/") else into)
    assert workdir == "/src"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "w"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("afd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    protos = sorted(p.stem for p in (REPO / "protos").rglob("*.proto"))
    for stem in protos:  # generated code ships in the wheel (no protos/ in the image)
        assert any(n.endswith(f"/{stem}_pb2.py") for n in names), stem
    assert any(n.startswith("services/gateway/") for n in names)
    assert any(n.startswith("afd_cli/") for n in names)
    entry = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith("entry_points.txt")))
        .decode()
    )
    assert re.search(r"^afd = afd_cli\.main:main$", entry, re.M)
