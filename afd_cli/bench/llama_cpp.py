"""llama.cpp as `afd bench peer` runs it, and each server's weights: the vendored source of the
llama-cpp-python sdist, built (natively, or with every instruction set but AMX where quantized
weights would meet ggml's AMX kernel), the benchmark checkpoint converted to GGUF bf16 with the
vendored converter, and, with `--quant mxfp4`, each side's MXFP4 copy made by its own tool."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path


def log(msg: str) -> None:
    print(f"[peer] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw) -> None:
    log(" ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def source_dir(cache: Path, version: str) -> Path:
    """The sdist's vendored llama.cpp, downloaded and unpacked once."""
    root = cache / f"llama_cpp_python-{version}"
    src = root / "vendor" / "llama.cpp"
    if src.is_dir():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + [f"llama-cpp-python=={version}", "-d", str(cache)]
        )
    with tarfile.open(sdist) as tar:
        tar.extractall(cache, filter="data")
    if not src.is_dir():
        raise SystemExit(f"{sdist} has no vendor/llama.cpp")
    return src


_TARGETS = ("llama-server", "llama-bench", "llama-quantize")

# x86 features (/proc/cpuinfo's names) -> llama.cpp's cmake options for them: the non-native
# build (`_no_amx_flags`) turns on each one the CPU has. GGML_AVX512 asks for all five.
_GGML_X86 = (
    (("sse4_2",), "GGML_SSE42"),
    (("f16c",), "GGML_F16C"),
    (("fma",), "GGML_FMA"),
    (("bmi2",), "GGML_BMI2"),
    (("avx",), "GGML_AVX"),
    (("avx2",), "GGML_AVX2"),
    (("avx_vnni",), "GGML_AVX_VNNI"),
    (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), "GGML_AVX512"),
    (("avx512vbmi",), "GGML_AVX512_VBMI"),
    (("avx512_vnni",), "GGML_AVX512_VNNI"),
    (("avx512_bf16",), "GGML_AVX512_BF16"),
)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def needs_no_amx(quant: str) -> bool:
    """Whether llama.cpp's quantized weights need the build without AMX here: its native build
    multiplies Q8_0 on AMX tiles where the CPU has AMX-INT8, and that kernel dies of SIGILL on
    its first tile instruction on such boxes (llama.cpp PR 26954: the tile state per thread);
    bf16 weights never reach it."""
    return quant != "bf16" and "amx_int8" in _cpu_flags()


def _no_amx_flags() -> list[str]:
    have = _cpu_flags()
    on = [opt for names, opt in _GGML_X86 if all(n in have for n in names)]
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}=ON" for opt in on)]


def build(cache: Path, version: str, jobs: int, no_amx: bool = False) -> Path:
    """llama-server, llama-bench and llama-quantize built from the vendored source (natively,
    or with every instruction set of this CPU but AMX); the server's path."""
    src = source_dir(cache, version)
    out = src / ("build-noamx" if no_amx else "build")
    missing = [t for t in _TARGETS if not (out / "bin" / t).is_file()]
    if not missing:
        return out / "bin" / "llama-server"
    if not (out / "CMakeCache.txt").is_file():
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
        flags += ["-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
        flags += _no_amx_flags() if no_amx else ["-DGGML_NATIVE=ON"]
        _run(["cmake", "-S", str(src), "-B", str(out), *flags])
    _run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *missing])
    return out / "bin" / "llama-server"


# Runs the vendored converter. The benchmark checkpoint carries afd's demo tokenizer: byte-level
# BPE with GPT-2's pre-tokenizer regex and no merges. The converter knows pre-tokenizers only by
# the hashes of real models' tokenizers: for an unknown hash it is told "gpt-2", which is what
# this one is. llama.cpp refuses a BPE vocabulary without merges: it gets one whose merged token
# is not in the vocabulary, which llama.cpp's tokenizer then spells in bytes, as before.
_CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion import base
known_pre, known_gpt2 = base.TextModel.get_vocab_base_pre, base.TextModel._set_vocab_gpt2
def pre(self, tokenizer):
    try:
        return known_pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
def gpt2(self):
    known_gpt2(self)
    if "tokenizer.ggml.merges" not in self.gguf_writer.kv_data[0]:
        self.gguf_writer.add_token_merges(["\u0120 \u0120"])
base.TextModel.get_vocab_base_pre = pre
base.TextModel._set_vocab_gpt2 = gpt2
script = sys.argv[2]
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def convert(cache: Path, version: str, checkpoint: Path) -> Path:
    """The checkpoint as GGUF bf16, converted once with the vendored script."""
    gguf = cache / f"{checkpoint.name}-bf16.gguf"
    if gguf.is_file():
        return gguf
    src = source_dir(cache, version)
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    tmp = gguf.with_suffix(".tmp")
    script = src / "convert_hf_to_gguf.py"
    cmd = [sys.executable, "-c", _CONVERT, str(src), str(script), str(checkpoint)]
    _run(cmd + ["--outtype", "bf16", "--outfile", str(tmp)], env=env)
    tmp.rename(gguf)
    return gguf


# What each server's weights are under --quant (recorded in the JSON), and the flags `afd serve`
# takes for it: with MXFP4 experts both sides hold attention and the head in 8 bits.
FORMATS = {
    "bf16": {"afd": "bf16", "llama.cpp": "bf16 (convert_hf_to_gguf.py --outtype bf16)"},
    "mxfp4": {
        "afd": "routed experts MXFP4 (afd quantize --mxfp4); attention and LM head block-FP8 "
        "as they load (--quantization fp8 --quantize-lm-head); router and embeddings bf16",
        "llama.cpp": "llama-quantize MXFP4_MOE: routed experts MXFP4; attention, embeddings "
        "and output head Q8_0; norms and router f32",
    },
}
AFD_ARGS = {"bf16": (), "mxfp4": ("--quantization", "fp8", "--quantize-lm-head")}


def quantized(cache: Path, server: Path, bf16_gguf: Path, ckpt: Path, quant: str):
    """(afd's checkpoint, llama.cpp's GGUF) for `quant`, each written once by its own tool."""
    if quant == "bf16":
        return ckpt, bf16_gguf
    from afd_cli.quantize import write

    mx = ckpt.with_name(f"{ckpt.name}-mxfp4")
    if not (mx / "config.json").is_file():
        log(f"afd quantize --mxfp4 {ckpt} {mx}")
        write(ckpt, mx, "mxfp4", progress=False)
    gguf = cache / f"{ckpt.name}-mxfp4moe.gguf"
    if not gguf.is_file():
        tmp = gguf.with_suffix(".tmp")
        _run([str(server.with_name("llama-quantize")), str(bf16_gguf), str(tmp), "MXFP4_MOE"],
             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        tmp.rename(gguf)
    return mx, gguf


def weight_bytes(path: Path) -> int:
    """A GGUF's size, or a checkpoint directory's safetensors."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)
