"""Read the deployment sources the tests check: the Dockerfile, docker-compose.yml, the rendered
Kubernetes manifests, and .ci/run. Parsing only; nothing here starts a process but a renderer."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
CI_RUN = REPO / ".ci" / "run"
# The Kubernetes release the manifests are validated against (kubernetes-validate's newest).
K8S_VERSION = "1.37.0"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# ------------------------------------------------------------------ Dockerfile


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        instr, _, rest = full.partition(" ")
        out.append((instr.upper(), rest.strip()))
    return out


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, from its FROM on (global ARGs before it dropped)."""
    stages: list[list[tuple[str, str]]] = []
    for instr, rest in dockerfile_instructions():
        if instr == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instr, rest))
    return stages


def dockerfile_env() -> dict[str, str]:
    """The image's ENV (the last stage's, KEY=VALUE form), as a container would start with."""
    env: dict[str, str] = {}
    for instr, rest in dockerfile_instructions():
        if instr == "FROM":
            env = {}
        elif instr == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def pip_installs(shell: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a shell command line, with the options
    that only choose an index dropped (where wheels come from, not what is installed)."""
    # ${VAR:+words}: optional arguments (the Dockerfile's torch index) that install nothing more
    shell = re.sub(r"\$\{\w+:\+[^}]*\}", "", shell)
    lex = shlex.shlex(shell, posix=True, punctuation_chars=True)
    commands: list[list[str]] = [[]]
    for tok in lex:
        if tok in ("&&", "||", ";", "|", "(", ")"):
            commands.append([])
        else:
            commands[-1].append(tok)
    installs = []
    for words in commands:
        if words[:2] != ["pip", "install"] and words[1:4] != ["-m", "pip", "install"]:
            continue
        keep, skip = [], False
        for w in words[words.index("install") + 1 :]:
            if skip:
                skip = False
            elif w in ("--index-url", "-i", "--extra-index-url"):
                skip = True
            else:
                keep.append(w)
        installs.append(keep)
    return installs


def ci_test_command() -> str:
    """The last line of .ci/run: the README's install-and-test command."""
    lines = [x for x in CI_RUN.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return lines[-1]


# ------------------------------------------------------------------ docker-compose.yml

_INTERP = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_]\w*))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation on every string value: $$, $VAR, ${VAR},
    ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group("dollar"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        body = m.group("braced")
        op = re.search(r":?[-?]", body)
        if not op:
            return env.get(body, "")
        name, word, unset_or_empty = body[: op.start()], body[op.end() :], op.group()[0] == ":"
        have = env.get(name)
        missing = have is None or (unset_or_empty and have == "")
        if op.group().endswith("-"):
            return word if missing else have
        if missing:
            raise ValueError(f"compose: required variable {name}: {word}")
        return have

    return _INTERP.sub(one, value)


def compose_file(env: dict[str, str] | None = None) -> dict:
    """deploy/docker-compose.yml as compose reads it: anchors merged, variables interpolated."""
    doc = yaml.safe_load(COMPOSE.read_text())
    return interpolate(doc, env if env is not None else {})


# ------------------------------------------------------------------ Kubernetes


def kustomize_cmd() -> list[str] | None:
    """How to render a kustomization here: kubectl's built-in kustomize, or kustomize itself."""
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(overlay: str) -> list[dict]:
    """The documents `kubectl kustomize deploy/k8s/<overlay>` prints."""
    cmd = kustomize_cmd()
    assert cmd is not None, "no kustomize renderer (kubectl or kustomize) on PATH"
    out = subprocess.run(
        [*cmd, str(K8S / overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kustomize {overlay} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def overlays() -> list[str]:
    return ["base"] + sorted(
        f"overlays/{p.name}" for p in (K8S / "overlays").iterdir() if p.is_dir()
    )


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def config_data(docs: list[dict], prefix: str = "afd-config") -> dict[str, str]:
    cms = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix)]
    assert len(cms) == 1, f"expected one ConfigMap {prefix}*"
    return cms[0].get("data", {})


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels only, as afd's manifests use) against a label set."""
    assert set(selector) <= {"matchLabels"}, f"unsupported selector {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


_KUBE_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command, args and env values: $$ is a literal $, an
    undefined reference stays as written."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _KUBE_VAR.sub(one, value)


def defined_metric_names(group: str = "attention") -> set[str]:
    """The gauge and counter names afd/metrics.py defines (for `group`'s service when the module
    groups them)."""
    from prometheus_client.metrics import MetricWrapperBase

    import afd.metrics as m

    groups = getattr(m, "GROUPS", None)
    objs = groups[group] if groups else [v for v in vars(m).values()]
    return {o._name for o in objs if isinstance(o, MetricWrapperBase)}
