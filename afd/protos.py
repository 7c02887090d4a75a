"""Builds the protobuf/gRPC code for protos/afd/v1/*.proto on demand.

Generated modules are never committed (.gitignore) or hand-edited. A wheel ships them (setup.py
generates them in build_py); a source checkout generates them here on first use, and again
whenever a .proto is newer than its generated modules. `protos/afd/v1/x.proto` becomes
`afd.v1.x_pb2` (+ `x_pb2_grpc`), so the generated imports need no rewriting.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from importlib import resources
from pathlib import Path

from afd.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent  # .../afd
PROTO_ROOT = PACKAGE_DIR.parent / "protos"  # present in a source checkout only

_lock = threading.Lock()
_checked = False


def proto_files(root: Path = PROTO_ROOT) -> list[str]:
    """The .proto files under `root`, as paths relative to it ("afd/v1/ffn.proto")."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.proto"))


def outputs(proto: str, out_dir: Path) -> list[Path]:
    """The modules protoc writes for `proto` under `out_dir`; the _pb2 one last."""
    stem = out_dir / proto[: -len(".proto")]
    return [stem.with_name(stem.name + "_pb2_grpc.py"), stem.with_name(stem.name + "_pb2.py")]


def generate(proto_root: Path, protos: list[str], out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) on `protos`, writing modules under `out_dir`."""
    try:
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ConfigError("grpcio-tools is needed to build the protobuf code") from e
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = ["protoc", f"-I{proto_root}", f"-I{well_known}"]
    args += [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    rc = protoc.main(args + [str(proto_root / p) for p in protos])
    if rc != 0:
        raise ConfigError(f"protoc failed ({rc}) on {', '.join(protos)}")


def _stale(proto: str) -> bool:
    mtime = (PROTO_ROOT / proto).stat().st_mtime
    return any(
        not p.exists() or p.stat().st_mtime < mtime for p in outputs(proto, PROTO_ROOT.parent)
    )


def _regenerate(proto: str) -> None:
    # Build in a private directory next to the target, then os.replace each file: another process
    # racing us sees either the old or the new module, never a half-written one. The _pb2 module
    # is replaced last, so whoever sees it fresh also sees a fresh _pb2_grpc.
    targets = outputs(proto, PROTO_ROOT.parent)
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".protoc-", dir=targets[0].parent))
    try:
        generate(PROTO_ROOT, [proto], tmp)
        for built, target in zip(outputs(proto, tmp), targets, strict=True):
            os.replace(built, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_generated() -> None:
    """Make sure every afd.v1 *_pb2 module exists and is not older than its .proto file.

    Call before importing a generated module. In an installed wheel (no protos/ beside the
    package) the generated code came with the wheel and nothing is done.
    """
    global _checked
    if _checked:
        return
    with _lock:
        if not _checked:
            if PROTO_ROOT.is_dir():
                for proto in proto_files():
                    if _stale(proto):
                        _regenerate(proto)
            _checked = True
