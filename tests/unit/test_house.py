"""The rules of the house (docs/architecture.md), checked on the tree as it is:

- `afd/` (the core) imports neither a service nor the entry points; each service imports only
  the core (never another service, never the entry points); `afd_cli/` sits above all;
- the FFN service loads no module of the attention service; the gateway loads no torch;
- no product file is over 400 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 400

# package -> top-level import prefixes it must never use
FORBIDDEN = {
    "afd": ("services", "afd_cli"),
    "services/attention": ("services.ffn", "services.gateway", "afd_cli"),
    "services/ffn": ("services.attention", "services.gateway", "afd_cli"),
    "services/gateway": ("services.attention", "services.ffn", "afd_cli"),
}


def _modules(root: str) -> list[Path]:
    generated = ("_pb2.py", "_pb2_grpc.py")
    return sorted(p for p in (REPO / root).rglob("*.py") if not p.name.endswith(generated))


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def _offenders(root: str, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{line}: imports {name}"
        for p in _modules(root)
        for line, name in _imports(p)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]


@pytest.mark.parametrize("root", sorted(FORBIDDEN))
def test_nothing_imports_upward_or_sideways(root):
    assert not _offenders(root, FORBIDDEN[root])


def test_the_import_check_can_fail(tmp_path, monkeypatch):
    bad = tmp_path / "services" / "ffn"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("from services.attention.engine import Engine\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert _offenders("services/ffn", FORBIDDEN["services/ffn"])


def _load_all(package: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = (
        "import importlib, pkgutil, sys\n"
        f"{prelude}\n"
        f"import {package} as pkg\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)


def test_the_ffn_service_loads_nothing_of_the_attention_service():
    res = _load_all("services.ffn")
    assert res.returncode == 0, res.stderr
    loaded = res.stdout.split()
    assert "services.ffn.server" in loaded
    assert not [m for m in loaded if m.startswith(("services.attention", "services.gateway"))]


def test_the_gateway_loads_no_torch():
    res = _load_all("services.gateway", "sys.modules['torch'] = None")
    assert res.returncode == 0, res.stderr
    assert "services.gateway.app" in res.stdout.split()


def test_no_product_file_is_over_the_limit():
    long = [
        f"{p.relative_to(REPO)}: {n} lines"
        for root in ("afd", "services", "afd_cli")
        for p in _modules(root)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long
