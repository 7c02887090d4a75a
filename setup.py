"""Build hook only: pyproject.toml holds the metadata.

build_py also compiles protos/**/*.proto into the build tree, so a wheel ships the generated
afd.v1 *_pb2 modules (a source checkout builds them on first use: afd/protos.py).

On x86-64 it compiles afd/kernels/*.c into one plain C library loaded with ctypes (no Python
API, no torch headers, so no torch in the build environment). It is optional: without a C
compiler the build still succeeds and afd uses torch's matmul (afd/kernels/gemm.py).
"""

import os
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        # An editable install runs from the source tree, which builds them on first use.
        if self.dry_run or getattr(self, "editable_mode", False) or not PROTO_ROOT.is_dir():
            return
        try:
            from grpc_tools import protoc
        except ImportError as e:
            raise SystemExit(
                "building afd needs grpcio-tools to compile protos/: add it to the build "
                "requirements or build with --no-build-isolation"
            ) from e
        from importlib import resources

        protos = sorted(str(p) for p in PROTO_ROOT.rglob("*.proto"))
        well_known = resources.files("grpc_tools") / "_proto"
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}"]
        args += [f"--python_out={self.build_lib}", f"--grpc_python_out={self.build_lib}"]
        if protoc.main(args + protos) != 0:
            raise SystemExit("protoc failed on " + ", ".join(protos))


class BuildExtOnEveryCore(build_ext):
    """The kernels are one extension of many C files, which distutils compiles one after
    another (its --parallel runs whole extensions side by side): each file is a compiler
    process of its own, so they run on every core, the objects linked in their given order."""

    def build_extension(self, ext: Extension) -> None:
        one_by_one = self.compiler.compile
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        jobs = min(len(ext.sources), cores or os.cpu_count() or 1)

        def compile_all(sources, *args, **kwargs):
            if jobs < 2 or len(sources) < 2:
                return one_by_one(sources, *args, **kwargs)
            with ThreadPoolExecutor(jobs) as pool:
                parts = pool.map(lambda src: one_by_one([src], *args, **kwargs), sources)
                return [obj for objs in parts for obj in objs]

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = one_by_one


def _kernels() -> list[Extension]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [
        Extension(
            "afd.kernels._native",
            sources=[
                f"afd/kernels/{name}.c"
                for name in (
                    "gemm",
                    "gemm512",
                    "amx",
                    "moe",
                    "attention",
                    "attention512",
                    "attention_amx",
                    "attention_chunks",
                    "norm_rope",
                    "decode_layer",
                    "decode_stack",
                    "heads",
                    "mla_layer",
                    "mlp",
                    "fp8",
                    "fp8_gemm",
                    "fp8_stream",
                    "indexer",
                    "mxfp4",
                    "mxfp4_moe",
                    "mxfp4_amx",
                    "experts",
                    "bitmask",
                    "argmax",
                    "sample",
                    "topk",
                    "runs",
                )
            ],
            depends=[
                f"afd/kernels/{h}.h"
                for h in (
                    "amx",
                    "attention512",
                    "attention_amx",
                    "bf16",
                    "bf16_512",
                    "experts",
                    "fp8_gemm",
                    "mla_layer",
                    "mxfp4",
                    "runs",
                    "softmax",
                )
            ],
            # -mavx2/-mfma: gemm.py loads the library only where ATen dispatches AVX2 or above.
            # fp-contract=off: a*b + c in scalar code stays two roundings, as torch computes it.
            extra_compile_args=["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        )
    ]


setup(
    cmdclass={"build_py": BuildPyWithProtos, "build_ext": BuildExtOnEveryCore},
    ext_modules=_kernels(),
)
