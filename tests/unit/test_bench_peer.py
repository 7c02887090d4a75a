"""`afd bench peer`'s choice of llama.cpp build: the one without AMX only for quantized weights
on a CPU with AMX-INT8 (llama.cpp's AMX kernel is what quantized weights reach there), and
that build turning on each instruction set the CPU has, AMX never."""

from afd_cli.bench import llama_cpp as peer

SPR = set("sse4_2 f16c fma bmi2 avx avx2 avx_vnni avx512f avx512cd avx512vl avx512dq".split())
SPR |= set("avx512bw avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16".split())
ZEN3 = set("sse4_2 f16c fma bmi2 avx avx2".split())


def _on(flags: list[str]) -> set[str]:
    return {f[2:-3] for f in flags if f.endswith("=ON")}


def test_no_amx_build_only_for_quantized_weights_on_amx(monkeypatch):
    monkeypatch.setattr(peer, "_cpu_flags", lambda: SPR)
    assert peer.needs_no_amx("mxfp4")
    assert not peer.needs_no_amx("bf16")
    monkeypatch.setattr(peer, "_cpu_flags", lambda: ZEN3 | {"avx512f", "avx512_bf16"})
    assert not peer.needs_no_amx("mxfp4")


def test_no_amx_flags_follow_the_cpu(monkeypatch):
    monkeypatch.setattr(peer, "_cpu_flags", lambda: SPR)
    flags = peer._no_amx_flags()
    assert "-DGGML_NATIVE=OFF" in flags
    assert _on(flags) == {
        "GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX", "GGML_AVX2",
        "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16",
    }  # fmt: skip
    monkeypatch.setattr(peer, "_cpu_flags", lambda: ZEN3)
    assert _on(peer._no_amx_flags()) == {
        "GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX", "GGML_AVX2",
    }  # fmt: skip
    # AVX-512 needs all five of its base parts
    monkeypatch.setattr(peer, "_cpu_flags", lambda: ZEN3 | {"avx512f", "avx512cd"})
    assert "GGML_AVX512" not in _on(peer._no_amx_flags())


def test_the_mxfp4_afd_flags_are_the_model_held_bytes_counts(tmp_path):
    """With MXFP4 experts afd serve starts with AFD_ARGS (attention and head 8-bit, as
    llama.cpp's recipe holds them): held_bytes counts the weights of the model those flags
    give, fewer than with the rest in bf16."""
    from afd.config import ModelConfig
    from afd_cli.bench.llama_cpp import AFD_ARGS
    from afd_cli.bench.peer import held_bytes
    from afd_cli.main import build_parser
    from afd_cli.quantize import write
    from services.attention.flags import engine_config
    from tests.helpers.checkpoints import REFERENCE_CHECKPOINTS

    src = REFERENCE_CHECKPOINTS["qwen3_moe"](tmp_path / "src")
    mx = write(src, tmp_path / "mx", "mxfp4", progress=False)
    args = build_parser().parse_args(["attention", "--model", str(mx), *AFD_ARGS["mxfp4"]])
    want = ModelConfig.from_hf(mx).with_quantization("fp8", lm_head=True)
    assert engine_config(args).model == want
    assert held_bytes(mx, "mxfp4") < held_bytes(mx, "bf16")
